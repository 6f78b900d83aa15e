"""The peers benchmark's run: one workload, every path side by side, interleaved.

What runs (all on loopback, in one Ray session started here):

* **knittrans**: two ``knit serve`` nodes (processes of their own); ranks read their own slices
  (:mod:`bench.peers.knit`); one micro-batch's read is ``StoreReader.fetch`` (over read channels);
* **TransferQueue** 0.1.11, the package itself: its controller and two storage units; ranks read
  their rows through its client (:mod:`bench.peers.tq`);
* **verl** 0.9.1, the package itself: the batch dispatched by its single controller to a Ray worker
  group as its PPO trainer does (a no-padding TensorDict chunked and ``ray.put`` per rank), and as a
  ``DataProto`` in both of its serializations (``torch.save``, numpy) (:mod:`bench.peers.verl_dp`);
* a **minimal Flight** server (:mod:`bench.minimal_flight`): the floor for a group's write (one DoPut) and
  for one micro-batch's read by one DoGet per node (``minimal_flight``, a diagnostic); its reads over one
  long-lived DoExchange per node (``minimal_flight_exchange``) are the floor of knittrans' own read
  channels. Each of the two read comparisons has servers of its own, as knittrans' nodes serve only its
  reads: a server that has just answered another path's read runs warm, and sharing one makes the
  exchange floor's median read faster (its caches, not its mechanism).

The groups are generated once (:func:`bench.cluster.workload.make_group`) and every path is given
them; the admission planner's plans fix each rank's micro-batches, the same on every path
(:func:`bench.peers.common.step_specs`). Servers, workers and the per-step DataProto batches are
built before any clock starts. A train step is timed on the driver, from the call that hands the
ranks their step to the last rank's return; plans go out one step at a time (prefetch only within a
step); paths take turns step by step, in a rotating order, and the first step of each (path,
compute) is a warm-up (computing nothing).

The calibrated cell (:func:`_calibrated`): groups and plans of its own (``make run``'s geometry), run by
knittrans, TransferQueue and verl's fastest path at compute 0 (``verl_best``), each rank held the
real trainer's measured time per 1k tokens (:mod:`bench.calibrate`). The multimodal cells:
:mod:`bench.peers.mm`.
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
from bench.peers.turns import StepFn, steps_in_turn

log = logging.getLogger(__name__)

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


def run(w: Workload, computes: Sequence[float], paths: Sequence[str], fetch_rounds: int, *,
        mm: Workload | None = None, enc_w: Workload | None = None, encoder_ms: float = 0.0,
        cal: tuple[Workload, float] | None = None) -> dict[str, Any]:
    """Every path on the same groups and plans; the raw records (see :func:`summarize`).

    ``mm``/``enc_w``: the multimodal cells' workloads (:mod:`bench.peers.mm`), ``encoder_ms`` the encoder's
    cost per image; ``cal``: the calibrated cell's workload and compute (ms per 1k tokens)."""
    import ray

    from bench.peers.knit import KnitPath
    from bench.store_groups import start_store_process

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
        tq = None
        if "transferqueue" in paths:
            from bench.peers.tq import TQPath

            tq = TQPath(w)
            stack.callback(tq.close)
            out["put"]["transferqueue"] = tq.load(groups)
            steppers["transferqueue"] = lambda s, per_rank, c: tq.step(per_rank, c, w.prefetch_depth)
            fetchers["transferqueue"] = tq.fetch_latencies
        verls = {f"verl_{m}": _verl(w, m, groups, specs, stack) for m in VERL_MODES if f"verl_{m}" in paths}
        steppers.update({v.name: v.step for v in verls.values()})
        fetchers.update(_minimal_fetchers(knit, groups, stack))
        out["steps"] = steps_in_turn(steppers, specs, computes)
        out["fetch"] = _fetch_rounds(fetchers, [m for step in specs for rank in step for m in rank], fetch_rounds)
        out["driver_payload_bytes_knittrans"] = _knit_driver_bytes(knit, specs)
        if cal is not None and verls:
            out["calibrated"] = _calibrated(knit, tq, verls, out["steps"], cal, computes[0])
        if mm is not None and enc_w is not None:
            from bench.peers.mm import run_mm

            out["mm"] = run_mm(knit, mm, enc_w, encoder_ms, stack)
        out["groups_bytes"] = sum(g.nbytes for g in groups)
        out["groups"] = len(groups)
        out["specs"] = {"micro_batches_per_rank_step": len(specs[0][0]),
                        "rows_per_micro_batch": statistics.mean(len(m["rows"]) for r in specs[0] for m in r),
                        "tokens_per_step": sum(m["tokens"] for r in specs[0] for m in r)}
        return out


def _plans(knit: Any, w: Workload, total: int) -> list[Any]:
    from bench.cluster.workload import CountingClient, admit

    return admit(CountingClient(knit.client), w, total)


VERL_MODES = ("trainer", "default", "numpy")
"""verl's ways to hand a batch to the ranks (:data:`bench.peers.verl_dp.MODES`); paths ``verl_<mode>``."""


def _verl(w: Workload, mode: str, groups: list[pa.RecordBatch], specs: list[list[list[MicroSpec]]],
          stack: contextlib.ExitStack) -> Any:
    from bench.peers.verl_dp import VerlPath

    path = VerlPath(w, mode)
    stack.callback(path.close)
    path.load(groups, specs)
    return path


def _calibrated(knit: Any, tq: Any, verls: dict[str, Any], steps: dict[str, Any], cal: tuple[Workload, float],
                c: float) -> dict[str, Any]:
    """knittrans, TransferQueue and verl's fastest path at ``c`` (its median step) on the calibrated cell's own
    groups and plans, at the calibrated compute; raw records, and which verl path ran."""
    w, compute_ms = cal
    best = min(verls, key=lambda name: statistics.median(r["step_s"] for r in steps[verls[name].name][f"{c:g}"]))
    rng = np.random.default_rng(w.seed + 3)
    groups = [make_group(f"cal-s{s}-g{g}", w, rng) for s in range(w.steps + 1) for g in range(w.groups)]
    knit.load(groups)
    specs = step_specs(_plans(knit, w, w.steps + 1), w.mini_batches, w.ranks)
    verl = verls[best]
    verl.w = w
    verl.load(groups, specs)
    steppers: dict[str, StepFn] = {"knittrans": lambda s, per_rank, c: knit.step(per_rank, c, w.prefetch_depth),
                                   "verl_best": verl.step}
    if tq is not None:
        tq.load(groups)
        steppers["transferqueue"] = lambda s, per_rank, c: tq.step(per_rank, c, w.prefetch_depth)
    return {"steps": steps_in_turn(steppers, specs, [compute_ms]), "verl_best": verl.name,
            "compute_ms_per_ktok": compute_ms, "tokens_per_step": sum(m["tokens"] for r in specs[0] for m in r)}


def _minimal_servers(knit: Any, groups: list[pa.RecordBatch], stack: contextlib.ExitStack) -> tuple[
        dict[str, Any], dict[str, Any], Any]:
    """A minimal Flight server beside each store node, holding that node's groups (the trainer's columns):
    a client and a kept DoExchange channel per server, and a thread pool for concurrent DoGets; all
    stopped with ``stack``."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow.flight as flight

    from bench import minimal_flight
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
    return clients, channels, pool


def _minimal_fetchers(knit: Any, groups: list[pa.RecordBatch],
                      stack: contextlib.ExitStack) -> dict[str, Callable[[list[MicroSpec]], list[float]]]:
    """The same rows from minimal Flight servers, one beside each store node holding that node's groups,
    the rows put back in the micro-batch's order (as knittrans' client reads): ``minimal_flight``, one DoGet
    per server a micro-batch, concurrently; ``minimal_flight_exchange``, one request per server a
    micro-batch over a DoExchange per server kept open, every request sent before any answer is read (as
    knittrans' read channels). Each on servers of its own (see the module's docstring); they stop with
    ``stack``."""
    from bench import minimal_flight
    from flight_store import streams
    from schemas.plan import PlannedSlice

    clients, _, pool = _minimal_servers(knit, groups, stack)
    _, channels, _ = _minimal_servers(knit, groups, stack)

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
    before = {n: s.bytes_out for n, s in knit.client.stats().items()}
    received = sum(r["wire_bytes"] for per_rank in specs for r in knit.step(per_rank, 0.0, 1))
    return sum(s.bytes_out - before[n] for n, s in knit.client.stats().items()) - received


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
    for name, by_c in raw["steps"].items():  # payload bytes the ranks received per step (the same rows everywhere)
        metrics[f"rank_bytes_per_step_{name}"] = statistics.median(r["bytes"] for r in by_c[f"{computes[0]:g}"])
    if 0.0 in computes:  # data movement alone: no compute to hide it behind
        knit = metrics["step_ms_knittrans_c0"]
        peers = {key: metrics[f"step_ms_{peer}_c0"] for peer, key in PEER_KEYS if f"step_ms_{peer}_c0" in metrics}
        ratios.update({f"data_movement_vs_{key}": v / knit for key, v in peers.items()})
        verl = {k: v for k, v in peers.items() if k.startswith("verl")}
        if verl:
            ratios["data_movement_vs_verl_best"] = min(verl.values()) / knit
            metrics["verl_best_c0"] = min(verl, key=lambda k: verl[k])
    if "calibrated" in raw:
        _summarize_calibrated(raw["calibrated"], metrics, ratios)
    if "mm" in raw:
        from bench.peers.mm import summarize_mm

        summarize_mm(raw["mm"], metrics, ratios)
    knit_p50 = metrics["fetch_p50_ms_knittrans"]
    if "fetch_p50_ms_transferqueue" in metrics:
        ratios["fetch_p50_vs_transferqueue"] = metrics["fetch_p50_ms_transferqueue"] / knit_p50
    ratios["fetch_p50_vs_minimal_flight"] = metrics["fetch_p50_ms_minimal_flight"] / knit_p50
    if "fetch_p50_ms_minimal_flight_exchange" in metrics:  # a diagnostic: the floor of knittrans' read channels
        ratios["fetch_p50_vs_minimal_flight_exchange"] = metrics["fetch_p50_ms_minimal_flight_exchange"] / knit_p50
    return metrics, ratios


PEER_KEYS = (("verl_trainer", "verl_trainer"), ("verl_dataproto_default", "verl_dataproto"),
             ("verl_dataproto_numpy", "verl_numpy"), ("transferqueue", "transferqueue"))
"""Each peer path's name and its key in ``data_movement_vs_<key>``."""


def _summarize_calibrated(cal: dict[str, Any], metrics: dict[str, Any], ratios: dict[str, Any]) -> None:
    """The calibrated cell's medians and ``step_vs_{verl_best,transferqueue}_calibrated``."""
    metrics["calibrated_compute_ms_per_ktok"] = cal["compute_ms_per_ktok"]
    metrics["calibrated_verl_best"] = cal["verl_best"]
    metrics["calibrated_tokens_per_step"] = cal["tokens_per_step"]
    step = {}
    for name, by_c in cal["steps"].items():
        recs = next(iter(by_c.values()))
        step[name] = metrics[f"calibrated_step_ms_{name}"] = 1e3 * statistics.median(r["step_s"] for r in recs)
    ratios["step_vs_verl_best_calibrated"] = step["verl_best"] / step["knittrans"]
    if "transferqueue" in step:
        ratios["step_vs_transferqueue_calibrated"] = step["transferqueue"] / step["knittrans"]


def params(w: Workload, computes: Sequence[float], paths: Sequence[str], quick: bool) -> dict[str, Any]:
    return {**asdict(w), "computes_ms_per_ktok": list(computes), "paths": list(paths), "quick": quick,
            "compute": "every tensor touched, then the rank held CPU-free ms_per_ktok per 1k real tokens",
            "transport": "loopback; stores, storage units and the minimal Flight server in processes of their own"}
