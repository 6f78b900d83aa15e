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
TQ_IMAGE_FIELDS = ("pixel_values", "image_grid_thw")
"""The processed-image fields of a multimodal row (:mod:`bench.cluster.processor`)."""


def group_images(gid: str, w: Workload) -> list[np.ndarray]:
    """The ``images_per_group`` images of group ``gid`` (uint8 pixels, from the seed and the group id)."""
    rng = np.random.default_rng([w.seed, 1, zlib.crc32(gid.encode())])
    return [rng.integers(0, 256, w.image_shape, dtype=np.uint8) for _ in range(w.images_per_group)]


class Rollout:
    """One rollout host's output, handed to every path as that path's rollout writes it."""

    def __init__(self, index: int, stores: list[str], serialization: str) -> None:
        import transfer_queue as tq

        from flight_store.reading import StoreReader
        from flight_store.writing import StoreWriter

        os.environ[SERIALIZATION_ENV] = serialization  # verl reads it when its DataProto is pickled
        self.index, self.store = index, stores[index]
        self.client = StoreWriter(stores)
        self.reader = StoreReader.sharing(self.client)  # releases what the trainer consumed
        tq.init()  # attaches to the driver's TransferQueue controller
        self.groups: dict[str, pa.RecordBatch] = {}
        self.pixels: dict[str, dict[str, Any]] = {}
        self.stored: list[str] = []
        self.outputs: dict[int, Any] = {}

    def generate(self, made: list[tuple[str, str]], w_doc: dict[str, Any], partition: str) -> dict[str, Any]:
        """Make the groups ``made`` (``(plain id, home id)`` pairs: the same group, its content from the plain id).

        knittrans gets each group twice: under its plain id DoPut (images first) to the node routing hashes it
        to (hash placement: the write may cross the network), and under its home id to this host's own node
        (local placement). TransferQueue gets each row ``kv_batch_put`` with its prompt's processed images; verl's
        rows are kept for :meth:`prepare_verl`. Returns payload bytes per path and the node of each copy."""
        import transfer_queue as tq

        from bench.cluster.processor import per_row
        from bench.peers.tq import group_fields
        from schemas.images import images_to_table

        w = Workload(**w_doc)
        knit = tq_bytes = 0
        nodes: dict[str, str] = {}
        for plain, home in made:
            rng = np.random.default_rng([w.seed, 0, zlib.crc32(plain.encode())])
            imgs = group_images(plain, w) if w.multimodal else []
            table, keys = images_to_table(imgs) if imgs else (None, [])
            g = make_group(plain, w, rng, keys)
            imaged: set[str] = set()
            for gid, node in ((plain, self.client.node_for(plain)), (home, self.store)):
                if table is not None and node not in imaged:  # a node holds an image once
                    self.client.put_images(table, node=node)
                    imaged.add(node)
                    knit += table.nbytes
                copy = g if gid == plain else _renamed(g, gid)
                self.client.put_group(copy, node=node)
                knit += copy.nbytes
                nodes[gid] = node
                self.stored.append(gid)
            keys_tq, fields, tags, n = group_fields(g)
            if imgs:  # every trajectory carries its prompt's processed images, as verl's rollout writes each sample
                self.pixels[plain] = per_row(imgs, g.num_rows)
                fields.update(self.pixels[plain])
                n += sum(int(t.numel() * t.element_size()) for t in self.pixels[plain].values())
            tq.kv_batch_put(keys=keys_tq, partition_id=partition, fields=fields, tags=tags)
            tq_bytes += n
            self.groups[plain] = g
        return {"knit_bytes": knit, "tq_bytes": tq_bytes, "nodes": nodes}

    def prepare_verl(self, s: int, gids: list[str], response_width: int) -> int:
        """Step ``s``'s ``DataProto`` of this host's groups ``gids`` (verl's rollout output: padded to
        ``response_width``, the processed images in every row); its tensor bytes."""
        from verl.protocol import DataProto

        if not gids:
            return 0
        table = pa.Table.from_batches([self.groups[g] for g in gids])
        batch = dataproto_shards(table, np.zeros(table.num_rows, np.float32), 1, response_width)[0]
        del batch["advantages"]  # the driver computes them (verl's compute_advantage runs on the driver)
        if gids[0] in self.pixels:
            import torch

            for k in self.pixels[gids[0]]:
                batch[k] = torch.cat([self.pixels[g][k] for g in gids])
        self.outputs[s] = DataProto.from_dict(tensors=batch)
        return sum(t.numel() * t.element_size() for t in batch.values())

    def output(self, s: int) -> Any:
        """Step ``s``'s rollout output (Ray pickles it here and the driver pulls it over this host's link)."""
        return self.outputs.pop(s)

    def clear(self, partition: str) -> None:
        """Drop this host's groups from every path."""
        import transfer_queue as tq

        keys = [f"{g}:{i}" for g, b in self.groups.items() for i in range(b.num_rows)]
        if keys:
            tq.kv_clear(keys=keys, partition_id=partition)
        self.reader.release(self.stored)
        self.groups, self.pixels, self.outputs, self.stored = {}, {}, {}, []


def _renamed(g: pa.RecordBatch, gid: str) -> pa.RecordBatch:
    at = g.schema.get_field_index("group_id")
    return pa.RecordBatch.from_arrays([pa.array([gid] * g.num_rows) if j == at else c for j, c in enumerate(g.columns)],
                                      schema=g.schema)


class ClusterRank:
    """One trainer-rank host's knittrans and TransferQueue ranks (one process; the paths take turns)."""

    def __init__(self, rank: int, stores: list[str]) -> None:
        import transfer_queue as tq

        from bench.peers.knit import KnitRank

        self.rank = rank
        self.knit = KnitRank(rank, stores)
        tq.init()

    def ready(self) -> int:
        from bench.cluster.processor import processor

        processor()  # built outside the clock
        return int(self.knit.ready())

    def knit_step(self, micros: list[MicroSpec], ms_per_ktok: float, mm: bool) -> dict[str, Any]:
        """knittrans: this rank's slices by DoGet, the next micro-batch prefetched; images once per mini-batch,
        through the image processor in the rank's clock."""
        if mm:
            from bench.cluster.processor import PIXEL_VALUES, process

            images = [0]

            def run(imgs: list[Any]) -> Any:
                images[0] += len(imgs)
                return process(imgs)[PIXEL_VALUES]

            return {**self.knit.step_mm(micros, ms_per_ktok, 0.0, True, 1, process=run), "images_processed": images[0]}
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
            read.pop("image_grid_thw", None)
            if pixels is not None:
                value["encode"] = pixels.reshape(-1, *pixels.shape[2:])
            value["tensors"] = pack_tensordict(td, spec["advantages"])
            return value

        return run_micro_batches(micros, get, ms_per_ktok=ms_per_ktok, depth=1, encoder=Encoder(0.0))

    def knit_call_s(self, slices: list[list[Any]], reps: int) -> list[float]:
        """Seconds of each of ``reps`` reads of ``slices`` (a few rows: a call's own cost, not the link's)."""
        from schemas.plan import PlannedSlice
        from train.packing import PACK_COLUMNS

        planned = [PlannedSlice(node=n, group_id=g, start=a, stop=b) for n, g, a, b in slices]
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            self.knit.client.fetch(planned, columns=PACK_COLUMNS)
            out.append(time.perf_counter() - t0)
        return out

    def tq_call_s(self, meta: Any, reps: int) -> list[float]:
        """Seconds of each of ``reps`` ``get_data`` calls of ``meta`` (a few rows)."""
        import transfer_queue as tq

        client = tq.get_client()
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            client.get_data(meta)
            out.append(time.perf_counter() - t0)
        return out

    def process_s(self, shape: list[int], images: int, reps: int) -> list[float]:
        """Seconds the image processor takes per image of ``shape`` (batches of ``images``)."""
        from bench.cluster.processor import process

        rng = np.random.default_rng(0)
        imgs = [rng.integers(0, 256, tuple(shape), dtype=np.uint8) for _ in range(images)]
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            process(imgs)
            out.append((time.perf_counter() - t0) / images)
        return out


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
