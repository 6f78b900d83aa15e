"""The peers benchmark's run: one workload, every path side by side, interleaved.

What runs (all on loopback, in one Ray session started here):

* **knittrans**: two ``knit serve`` nodes (processes of their own); ranks DoGet their own slices
  (:mod:`bench.peers.knit`); one micro-batch's read is ``StoreClient.fetch`` (over read channels);
* **TransferQueue** 0.1.11, the package itself: its controller and two storage units; ranks read
  their rows through its client (:mod:`bench.peers.tq`);
* **verl** 0.9.1, the package itself: ``DataProto`` dispatched by its single controller to a Ray
  worker group, with its default serialization, its numpy one, and ObjectRefs handed to the ranks
  (:mod:`bench.peers.verl_dp`);
* a **minimal Flight** server (:mod:`bench.minimal_flight`): the floor for a group's write (one DoPut) and
  for one micro-batch's read by one DoGet per node (``minimal_flight``); its reads over one long-lived
  DoExchange per node (``minimal_flight_exchange``, a diagnostic) are the floor of knittrans' own read
  channels.

The groups are generated once (:func:`bench.cluster.workload.make_group`) and every path is given
them; the admission planner's plans fix each rank's micro-batches, the same on every path
(:func:`bench.peers.common.step_specs`). Servers, workers and the per-step DataProto batches are
built before any clock starts. A train step is timed on the driver, from the call that hands the
ranks their step to the last rank's return; plans go out one step at a time (prefetch only within a
step); paths take turns step by step, in a rotating order, and the first step of each (path,
compute) is a warm-up.

With a multimodal workload (:func:`_mm`), groups of their own carry one image each and run the 2x2
of :data:`MM_CELLS` on knittrans and verl's default path, the encoder's cost set by
:data:`ENCODER_PER_IMAGE_KTOK`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import pyarrow as pa

from bench.cluster.workload import Workload, make_group
from bench.peers.common import MicroSpec, step_specs

log = logging.getLogger(__name__)

StepFn = Callable[[int, list[list[MicroSpec]], float], list[dict[str, Any]]]


@contextlib.contextmanager
def ray_env() -> Iterator[None]:
    """What TransferQueue needs of Ray on a small loopback machine (set before ``ray.init``), undone on exit:
    the single-node setting would make any later Ray cluster of this process refuse worker nodes."""
    wanted = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "TQ_NUM_THREADS": "2"}  # its storage units bind to loopback
    before = {k: os.environ.get(k) for k in wanted}
    for k, v in wanted.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, old in before.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def run(w: Workload, computes: Sequence[float], paths: Sequence[str], fetch_rounds: int,
        mm: Workload | None = None, mm_computes: Sequence[float] = ()) -> dict[str, Any]:
    """Every path on the same groups and plans; the raw records (see :func:`summarize`)."""
    import ray

    from bench.flight_throughput import start_store_process
    from bench.peers.knit import KnitPath

    total = w.steps + 1  # + one warm-up step
    rng = np.random.default_rng(w.seed)
    groups = [make_group(f"s{s}-g{g}", w, rng) for s in range(total) for g in range(w.groups)]
    with contextlib.ExitStack() as stack:  # everything started here is stopped, last first
        nodes = [stack.enter_context(start_store_process()) for _ in range(2)]
        stack.enter_context(ray_env())  # undone after ray.shutdown (the stack unwinds last first)
        ray.init(num_cpus=16, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level=logging.WARNING)
        stack.callback(ray.shutdown)
        knit = KnitPath(w, [n.location for n in nodes])
        stack.callback(knit.close)
        out: dict[str, Any] = {"put": {"knittrans": knit.load(groups)}}
        specs = step_specs(_plans(knit, w, total), w.mini_batches, w.ranks)
        steppers: dict[str, StepFn] = {"knittrans": lambda s, per_rank, c: knit.step(per_rank, c, w.prefetch_depth)}
        fetchers: dict[str, Callable[[list[MicroSpec]], list[float]]] = {"knittrans": knit.fetch_latencies}
        if "transferqueue" in paths:
            from bench.peers.tq import TQPath

            tq = TQPath(w)
            stack.callback(tq.close)
            out["put"]["transferqueue"] = tq.load(groups)
            steppers["transferqueue"] = lambda s, per_rank, c: tq.step(per_rank, c, w.prefetch_depth)
            fetchers["transferqueue"] = tq.fetch_latencies
        for mode in ("default", "numpy", "objectref"):
            if f"verl_{mode}" in paths:
                steppers[f"verl_dataproto_{mode}"] = _verl(w, mode, groups, specs, stack)
        fetchers.update(_minimal_fetchers(knit, groups, stack))
        out["steps"] = _steps(steppers, specs, computes)
        out["fetch"] = _fetch_rounds(fetchers, [m for step in specs for rank in step for m in rank], fetch_rounds)
        out["driver_payload_bytes_knittrans"] = _knit_driver_bytes(knit, specs)
        if mm is not None:
            out["mm"] = _mm(knit, mm, mm_computes, stack)
        out["groups_bytes"] = sum(g.nbytes for g in groups)
        out["groups"] = len(groups)
        out["specs"] = {"micro_batches_per_rank_step": len(specs[0][0]),
                        "rows_per_micro_batch": statistics.mean(len(m["rows"]) for r in specs[0] for m in r),
                        "tokens_per_step": sum(m["tokens"] for r in specs[0] for m in r)}
        return out


def _plans(knit: Any, w: Workload, total: int) -> list[Any]:
    from bench.cluster.workload import CountingClient, admit

    return admit(CountingClient(knit.client), w, total)


def _verl(w: Workload, mode: str, groups: list[pa.RecordBatch], specs: list[list[list[MicroSpec]]],
          stack: contextlib.ExitStack) -> StepFn:
    from bench.peers.verl_dp import VerlPath

    path = VerlPath(w, mode)
    stack.callback(path.close)
    path.load(groups, specs)
    return path.step


ENCODER_PER_IMAGE_KTOK = 0.09
"""Encoder cost of one image in units of the backbone's cost per 1k tokens, from a real model pair:
Qwen2.5-VL-7B's vision tower (0.67B parameters) over one 448x448 image (1,024 patches of 14x14) takes
2 x 0.67e9 x 1024 = 1.37 TFLOP forward; its 7.6B-parameter language model takes 2 x 7.6e9 x 1000 =
15.2 TFLOP per 1k tokens: 1.37 / 15.2 = 0.09."""

MM_CELLS = {
    "replicated_per_ref": ("verl", False), "replicated_dedup": ("verl", True),
    "by_ref_per_ref": ("knittrans", False), "by_ref_dedup": ("knittrans", True),
}
"""The multimodal 2x2: data path (each row carries its image through verl's controller, or the image is
stored once and read by key) x encoder (every reference, or each distinct image once per mini-batch:
by key on knittrans, by hashing the pixels on verl's path, which has no keys)."""


def _mm(knit: Any, w: Workload, computes: Sequence[float], stack: contextlib.ExitStack) -> dict[str, Any]:
    """The multimodal 2x2 on its own groups (one image each, shared by the group's rows); raw records."""
    from bench.cluster.workload import CountingClient, admit
    from bench.peers.verl_dp import VerlPath
    from schemas.images import images_to_table

    rng = np.random.default_rng(w.seed + 1)
    total = w.steps + 1
    groups: list[pa.RecordBatch] = []
    tables: list[pa.Table] = []
    images: dict[bytes, np.ndarray] = {}
    for s in range(total):
        for g in range(w.groups):
            imgs = [rng.integers(0, 256, w.image_shape, dtype=np.uint8) for _ in range(w.images_per_group)]
            table, keys = images_to_table(imgs)
            images.update(zip(keys, imgs, strict=True))
            tables.append(table)
            groups.append(make_group(f"mm-s{s}-g{g}", w, rng, keys))
    put = knit.load_mm(groups, tables)
    specs = step_specs(admit(CountingClient(knit.client), w, total), w.mini_batches, w.ranks)
    verl = VerlPath(w, "default")
    stack.callback(verl.close)
    verl.load(groups, specs, images=images)
    steppers: dict[str, StepFn] = {}
    for cell, (path, dedup) in MM_CELLS.items():
        def stepper(s: int, per_rank: list[list[MicroSpec]], c: float, path: str = path,
                    dedup: bool = dedup) -> list[dict[str, Any]]:
            enc = ENCODER_PER_IMAGE_KTOK * c
            if path == "verl":
                return verl.step(s, per_rank, c, enc, dedup)
            return list(knit.step_mm(per_rank, c, enc, dedup, w.prefetch_depth))
        steppers[cell] = stepper
    return {"steps": _steps(steppers, specs, computes), "put": put, "image_bytes": int(np.prod(w.image_shape)),
            "distinct_images_per_step": w.groups * w.images_per_group}


def _minimal_fetchers(knit: Any, groups: list[pa.RecordBatch],
                      stack: contextlib.ExitStack) -> dict[str, Callable[[list[MicroSpec]], list[float]]]:
    """The same rows from minimal Flight servers, one beside each store node holding that node's groups,
    the rows put back in the micro-batch's order (as knittrans' client reads): ``minimal_flight``, one DoGet
    per server a micro-batch, concurrently; ``minimal_flight_exchange``, one request per server a
    micro-batch over a DoExchange per server kept open, every request sent before any answer is read (as
    knittrans' read channels). The servers stop with ``stack``."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow.flight as flight

    from bench import minimal_flight
    from flight_store import streams
    from schemas.plan import PlannedSlice
    from train.packing import PACK_COLUMNS

    stores = knit.client.nodes
    servers = [minimal_flight.start() for _ in stores]
    clients = {node: flight.connect(loc) for node, (_, loc) in zip(stores, servers, strict=True)}
    channels = {node: minimal_flight.open_channel(c) for node, c in clients.items()}
    pool = ThreadPoolExecutor(len(stores))

    def stop() -> None:
        pool.shutdown()
        for writer, _ in channels.values():
            writer.done_writing()
            writer.close()
        for c in clients.values():
            c.close()
        for proc, _ in servers:
            proc.kill()
            proc.wait(timeout=10)

    stack.callback(stop)
    for g in groups:
        gid = str(g.column("group_id")[0])
        minimal_flight.put(clients[knit.client.node_for(gid)], gid, g.select(PACK_COLUMNS))

    def fetch(micros: list[MicroSpec]) -> list[float]:
        out = []
        for m in micros:
            slices = [PlannedSlice(node=node, group_id=g, start=a, stop=b) for node, g, a, b in m["slices"]]
            t0 = time.perf_counter()
            by_node = [(node, [(s.group_id, s.start, s.stop) for s in ss])
                       for node, ss in streams.by_node(slices).items()]
            if len(by_node) == 1:
                minimal_flight.get(clients[by_node[0][0]], by_node[0][1])
            else:  # the rows back in the micro-batch's order, as knittrans' client hands them over
                got = pool.map(lambda item: minimal_flight.get(clients[item[0]], item[1]), by_node)
                streams.in_order(slices, {node: t for (node, _), t in zip(by_node, got, strict=True)})
            out.append(time.perf_counter() - t0)
        return out

    def fetch_exchange(micros: list[MicroSpec]) -> list[float]:
        out = []
        for m in micros:
            slices = [PlannedSlice(node=node, group_id=g, start=a, stop=b) for node, g, a, b in m["slices"]]
            t0 = time.perf_counter()
            per_node = streams.by_node(slices)
            for node, ss in per_node.items():
                minimal_flight.send(channels[node], [(s.group_id, s.start, s.stop) for s in ss])
            streams.in_order(slices, {node: minimal_flight.receive(channels[node]) for node in per_node})
            out.append(time.perf_counter() - t0)
        return out

    return {"minimal_flight": fetch, "minimal_flight_exchange": fetch_exchange}


def _steps(steppers: dict[str, StepFn], specs: list[list[list[MicroSpec]]],
           computes: Sequence[float]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every path's train steps at every compute value, paths taking turns; records without warm-ups."""
    names = list(steppers)
    out: dict[str, dict[str, list[dict[str, Any]]]] = {n: {} for n in names}
    for c in computes:
        for s, per_rank in enumerate(specs):
            k = s % len(names)
            for name in names[k:] + names[:k]:
                t_wall = time.time()
                t0 = time.perf_counter()
                ranks = steppers[name](s, per_rank, c)
                step_s = time.perf_counter() - t0
                if s == 0:
                    continue  # warm-up
                out[name].setdefault(f"{c:g}", []).append({
                    "step_s": step_s,
                    "first_wait_s": max(r["start"] - t_wall + r["first_wait_s"] for r in ranks),
                    "wait_s": max(r["start"] - t_wall + r["wait_s"] for r in ranks),
                    "tokens": sum(r["tokens"] for r in ranks), "bytes": sum(r["bytes"] for r in ranks),
                    "encoder_passes": sum(r.get("encoder_passes", 0) for r in ranks)})
            log.info("compute %s ms/1k tok: step %d done", c, s)
    return out


def _fetch_rounds(fetchers: dict[str, Callable[[list[MicroSpec]], list[float]]], micros: list[MicroSpec],
                  rounds: int) -> dict[str, list[float]]:
    """One micro-batch read at a time, every path in turn on each micro-batch (so they share the machine's
    moments); seconds each."""
    out: dict[str, list[float]] = {n: [] for n in fetchers}
    names = list(fetchers)
    for i in range(rounds + 1):
        for j, m in enumerate(micros):
            k = j % len(names)
            for name in names[k:] + names[:k]:
                t = fetchers[name]([m])
                if i:  # round 0 warms up
                    out[name].extend(t)
    return out


def _knit_driver_bytes(knit: Any, specs: list[list[list[MicroSpec]]]) -> int:
    """Payload bytes the stores served beyond what knittrans' ranks received over one pass of every step."""
    before = {n: s["bytes_out"] for n, s in knit.client.stats().items()}
    received = sum(r["bytes"] for per_rank in specs for r in knit.step(per_rank, 0.0, 1))
    return sum(s["bytes_out"] - before[n] for n, s in knit.client.stats().items()) - received


def summarize(raw: dict[str, Any], w: Workload, computes: Sequence[float]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``metrics`` and ``ratios`` of the result file."""
    metrics: dict[str, Any] = {"workload": raw["specs"], "groups_bytes": raw["groups_bytes"],
                               "driver_payload_bytes_knittrans": raw["driver_payload_bytes_knittrans"]}
    for name, by_c in raw["steps"].items():
        for c, recs in by_c.items():
            metrics[f"step_ms_{name}_c{c}"] = 1e3 * statistics.median(r["step_s"] for r in recs)
            metrics[f"first_wait_ms_{name}_c{c}"] = 1e3 * statistics.median(r["first_wait_s"] for r in recs)
            metrics[f"wait_ms_{name}_c{c}"] = 1e3 * statistics.median(r["wait_s"] for r in recs)
    for name, ts in raw["fetch"].items():
        metrics[f"fetch_p50_ms_{name}"] = 1e3 * float(np.percentile(ts, 50))
        metrics[f"fetch_p99_ms_{name}"] = 1e3 * float(np.percentile(ts, 99))
    for name, put in raw["put"].items():  # the same groups, one write each (TQ's carry the trainer's columns only)
        metrics[f"load_gbps_{name}"] = put["bytes"] / put["put_s"] / 1e9
        metrics[f"load_ms_per_group_{name}"] = 1e3 * put["put_s"] / raw["groups"]
    ratios: dict[str, Any] = {}
    for c in computes:
        knit = metrics.get(f"step_ms_knittrans_c{c:g}")
        for peer, key in (("verl_dataproto_default", "verl_dataproto"), ("verl_dataproto_numpy", "verl_numpy"),
                          ("verl_dataproto_objectref", "verl_objectref"), ("transferqueue", "transferqueue")):
            other = metrics.get(f"step_ms_{peer}_c{c:g}")
            if knit and other:
                ratios[f"step_vs_{key}_c{c:g}"] = other / knit
    if "mm" in raw:
        _summarize_mm(raw["mm"], metrics, ratios)
    knit_p50 = metrics["fetch_p50_ms_knittrans"]
    if "fetch_p50_ms_transferqueue" in metrics:
        ratios["fetch_p50_vs_transferqueue"] = metrics["fetch_p50_ms_transferqueue"] / knit_p50
    ratios["fetch_p50_vs_minimal_flight"] = metrics["fetch_p50_ms_minimal_flight"] / knit_p50
    if "fetch_p50_ms_minimal_flight_exchange" in metrics:  # a diagnostic: the floor of knittrans' read channels
        ratios["fetch_p50_vs_minimal_flight_exchange"] = metrics["fetch_p50_ms_minimal_flight_exchange"] / knit_p50
    return metrics, ratios


def _summarize_mm(mm: dict[str, Any], metrics: dict[str, Any], ratios: dict[str, Any]) -> None:
    """The multimodal 2x2's medians per cell and compute, and its two gains kept apart."""
    metrics["mm_image_bytes"] = mm["image_bytes"]
    metrics["mm_distinct_images_per_step"] = mm["distinct_images_per_step"]
    metrics["mm_encoder_per_image_ktok"] = ENCODER_PER_IMAGE_KTOK
    for cell, by_c in mm["steps"].items():
        for c, recs in by_c.items():
            metrics[f"mm_step_ms_{cell}_c{c}"] = 1e3 * statistics.median(r["step_s"] for r in recs)
            metrics[f"mm_first_wait_ms_{cell}_c{c}"] = 1e3 * statistics.median(r["first_wait_s"] for r in recs)
            metrics[f"mm_encoder_passes_{cell}_c{c}"] = statistics.median(r["encoder_passes"] for r in recs)
            metrics[f"mm_rank_bytes_{cell}_c{c}"] = statistics.median(r["bytes"] for r in recs)
    for c in mm["steps"]["by_ref_dedup"]:
        step = {cell: metrics[f"mm_step_ms_{cell}_c{c}"] for cell in MM_CELLS}
        ratios[f"mm_data_path_c{c}"] = step["replicated_per_ref"] / step["by_ref_per_ref"]
        ratios[f"mm_encoder_dedup_c{c}"] = step["by_ref_per_ref"] / step["by_ref_dedup"]
        ratios[f"mm_step_vs_verl_c{c}"] = step["replicated_per_ref"] / step["by_ref_dedup"]


def params(w: Workload, computes: Sequence[float], paths: Sequence[str], quick: bool) -> dict[str, Any]:
    return {**asdict(w), "computes_ms_per_ktok": list(computes), "paths": list(paths), "quick": quick,
            "compute": "every tensor touched, then the rank held CPU-free ms_per_ktok per 1k real tokens",
            "transport": "loopback; stores, storage units and the minimal Flight server in processes of their own"}
