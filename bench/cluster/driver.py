"""The cluster benchmark's driver program: runs inside the driver host, joins the Ray cluster, runs the three paths.

``python -m bench.cluster.driver SPEC.json OUT.json`` (started by :mod:`bench.cluster.topology`, never by
hand). The spec names the hosts' addresses, the store nodes, the workloads and the compute. For each
workload (text, then multimodal) the rollouts make their groups, the planner plans every train step
over the stores' metadata (the same plans on every path), and the paths take turns step by step, in a
rotating order, the first step of each a warm-up. Each step's record carries its wall-clock window
(``t0``, ``t1``: the topology attributes link bytes and CPU to it) and the driver host's own link bytes.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import numpy as np
import polars as pl

from bench.cluster.actors import SERIALIZATION_ENV, TQ_FIELDS, TQ_IMAGE_FIELDS, ClusterRank, Rollout, verl_rank_class
from bench.cluster.calibrate import calibrate
from bench.cluster.workload import Workload, link_model, plan_step
from bench.peers.common import MicroSpec, step_specs
from schemas.routing import home_id

log = logging.getLogger(__name__)

PATHS = ("verl", "transferqueue", "knittrans", "knittrans_hash")
"""The ways a train batch reaches the ranks (the package docstring says how each runs): ``knittrans`` is the
coordinated transfer (local placement, rank assignment by links), ``knittrans_hash`` the same groups placed by
the hash and assigned by tokens alone."""
VERL_SERIALIZATION = "numpy"
"""verl's faster DataProto pickling (``serialize_tensordict``: numpy views pickled out of band)."""
StepFn = Callable[[], dict[str, Any]]
JOIN_S = 600
"""Seconds the driver waits for every host's Ray node to join."""
QUIET_S = 0.15
"""Pause before each path's step: longer than two of the sampler's periods, so the samples enclosing a step's window
hold none of the previous path's traffic."""


def _link() -> tuple[int, int]:
    """This host's own link counters (rx, tx bytes): ``ip netns exec`` gives the namespace its own sysfs."""
    base = Path("/sys/class/net/eth0/statistics")
    return int((base / "rx_bytes").read_text()), int((base / "tx_bytes").read_text())


class Driver:
    """The single controller's process: Ray, TransferQueue's controller, the actors on every host."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import ray
        import transfer_queue as tq
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

        os.environ[SERIALIZATION_ENV] = VERL_SERIALIZATION  # what the rollouts pickle, the driver unpickles
        self.spec = spec
        n, d = spec["n_stores"], spec["n_ranks"]
        ray.init(address=f"{spec['head']}:6379", _node_ip_address=spec["driver_address"],
                 logging_level=logging.WARNING)
        deadline = time.monotonic() + JOIN_S
        while len([x for x in ray.nodes() if x["Alive"]]) < 1 + n + d:
            if time.monotonic() > deadline:
                msg = f"the Ray cluster has {len(ray.nodes())} nodes after {JOIN_S} s, expected {1 + n + d}"
                raise RuntimeError(msg)
            time.sleep(0.5)
        tq.init({"backend": {"storage_backend": "SimpleStorage", "SimpleStorage": {
            "num_data_storage_units": n, "required_node_resource": "tq_store"}}})
        self.tq = tq.get_client()
        self.rollouts: list[Any] = [ray.remote(Rollout).options(num_cpus=0, resources={f"store{i}": 1}).remote(  # type: ignore[attr-defined]
            i, spec["stores"], VERL_SERIALIZATION) for i in range(n)]
        self.ranks: list[Any] = [ray.remote(ClusterRank).options(num_cpus=0, resources={f"rank{j}": 1}).remote(  # type: ignore[attr-defined]
            j, spec["stores"]) for j in range(d)]
        ray.get([r.ready.remote() for r in self.ranks])
        # One bundle of every CPU a rank host offers: only rank hosts can hold one, one rank per host.
        self.pool: Any = RayResourcePool(process_on_nodes=[1] * d, use_gpu=False,
                                         max_colocate_count=spec["rank_host_cpus"])
        self.group: Any = cast(Any, RayWorkerGroup)(
            resource_pool=self.pool, ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(verl_rank_class())),
            worker_env={SERIALIZATION_ENV: VERL_SERIALIZATION})
        self.group.ready()
        from flight_store.reading import StoreReader

        self.client = StoreReader(spec["stores"])
        self.peer_reader = StoreReader.sharing(self.client)  # the peers' plans, made outside their clocks
        self.knit_readers = {a: StoreReader.sharing(self.client) for a in ("links", "tokens")}  # a cursor each
        self.link_model = link_model(spec["stores"], d, spec["link_mbit"])

    def workload(self, kind: str, w: Workload) -> dict[str, Any]:
        """One workload on every path, step by step: the rollouts make the step's groups (outside every clock),
        the peers' plan is made, then the paths take turns; the raw records."""
        import ray

        n = self.spec["n_stores"]
        doc = asdict(w)
        steps: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
        put, same, verl_bytes = [], [], []
        for s in range(w.steps + 1):
            plain = [f"{kind}-s{s}-g{g}" for g in range(w.groups)]
            made = [[(gid, home_id(self.spec["node_ids"][g % n], gid)) for g, gid in enumerate(plain) if g % n == i]
                    for i in range(n)]
            put.append(ray.get([r.generate.remote(made[i], doc, kind) for i, r in enumerate(self.rollouts)]))
            homes = [h for per_host in made for _, h in per_host]
            frame = self.peer_reader.scan_new()
            plans = plan_step(frame.filter(pl.col("group_id").is_in(plain)), w, "tokens", None)
            per_rank = step_specs(plans, w.mini_batches, w.ranks)[0]
            step_gids = list(dict.fromkeys(row[0] for r in per_rank for m in r for row in m["rows"]))
            owner = {gid: g % n for g, gid in enumerate(plain)}  # the rollout host that made it holds verl's rows
            verl_bytes.append(sum(ray.get([r.prepare_verl.remote(s, [g for g in step_gids if owner[g] == i],
                                                                 w.response_max)
                                           for i, r in enumerate(self.rollouts)])))
            steppers: dict[str, StepFn] = {
                "verl": functools.partial(self._verl_step, s, per_rank, owner, step_gids, w),
                "transferqueue": functools.partial(self._tq_step, per_rank, kind, w),
                "knittrans": functools.partial(self._knit_step, homes, "links", w),
                "knittrans_hash": functools.partial(self._knit_step, plain, "tokens", w),
            }
            recs = _take_turns(steppers, s)
            same.append({p: sorted({row[0].rsplit("/", 1)[-1] for r in rec["per_rank"] for m in r
                                    for row in m["rows"]}) for p, rec in recs.items()})
            if s:  # step 0 of each path is a warm-up
                for p, rec in recs.items():
                    steps[p].append(rec)
        ray.get([r.clear.remote(kind) for r in self.rollouts])
        return {"steps": steps, "put": put, "verl_rollout_bytes": verl_bytes, "step_groups": same,
                "micro_batches_per_rank": [len(m) for m in steps["knittrans"][0]["per_rank"]] if steps["knittrans"]
                else [], "tokens_per_step": [r["tokens"] for r in steps["knittrans"]]}

    def _verl_step(self, s: int, per_rank: list[list[MicroSpec]], owner: dict[str, int], gids: list[str],
                   w: Workload) -> dict[str, Any]:
        """verl's step: gather the rollouts' DataProto, reorder rows per rank (padded to equal chunks by
        repeating rows, as verl's ``pad_dataproto_to_divisor``), add advantages, ``update_actor``."""
        import ray
        import torch
        from verl.protocol import DataProto

        t_gather = time.time()
        hosts = sorted({owner[g] for g in gids})
        parts = ray.get([self.rollouts[i].output.remote(s) for i in hosts])
        data = DataProto.concat(parts)
        t_gathered = time.time()
        order = [(g, i) for h in hosts for g in gids if owner[g] == h for i in range(w.group_size)]
        where = {row: n for n, row in enumerate(order)}
        rows = [[where[(g, int(i))] for m in micros for g, i in m["rows"]] for micros in per_rank]
        per = max(len(r) for r in rows)
        idx = [x for r in rows for x in (r + [r[0]] * (per - len(r)))]
        adv = [a for micros in per_rank for a in
               [x for m in micros for x in m["advantages"]] + [0.0] * (per - sum(len(m["rows"]) for m in micros))]
        data = data.select_idxs(torch.tensor(idx))
        rwidth = data.batch["responses"].shape[1]
        data.batch["advantages"] = torch.tensor(adv, dtype=torch.float32)[:, None].expand(-1, rwidth).contiguous()
        micros = [[{"index": i, "mini": m["mini"], "n_rows": len(m["rows"]), "tokens": int(m["tokens"])}
                   for i, m in enumerate(ms)] for ms in per_rank]
        data.meta_info = {"micros": micros, "ms_per_ktok": self.spec["ms_per_ktok"], "t_gather": t_gather}
        nbytes = sum(t.numel() * t.element_size() for t in data.batch.values())
        out = self.group.update_actor(data)
        recs = out.meta_info["metrics"]
        return {"transfer_s": max(recs["recv_s"]), "gather_s": t_gathered - t_gather, "dispatched_bytes": nbytes,
                "ranks": [{k: v[r] for k, v in recs.items()} for r in range(len(per_rank))], "per_rank": per_rank}

    def _tq_step(self, per_rank: list[list[MicroSpec]], partition: str, w: Workload) -> dict[str, Any]:
        """TransferQueue's step: the step's keys resolved once (one controller call, in the transfer's clock), a
        ``BatchMeta`` per micro-batch handed to its rank, each rank ``get_data``\\ s its own."""
        import ray

        t0 = time.perf_counter()
        keys = [f"{g}:{int(i)}" for micros in per_rank for m in micros for g, i in m["rows"]]
        fields = [*TQ_FIELDS, *TQ_IMAGE_FIELDS] if w.multimodal else list(TQ_FIELDS)
        meta = self.tq.kv_retrieve_meta(keys=keys, partition_id=partition).select_fields(fields)
        metas, at = [], 0
        for micros in per_rank:
            mine = []
            for m in micros:
                mine.append(meta.select_samples(list(range(at, at + len(m["rows"])))))
                at += len(m["rows"])
            metas.append(mine)
        lookup = time.perf_counter() - t0
        recs = ray.get([r.tq_step.remote(metas[j], _indexed(per_rank[j]), self.spec["ms_per_ktok"])
                        for j, r in enumerate(self.ranks)])
        return {"transfer_s": lookup + max(r["fetch_s"] for r in recs), "lookup_s": lookup, "keys": len(keys),
                "ranks": recs, "per_rank": per_rank}

    def _knit_step(self, gids: list[str], assignment: str, w: Workload) -> dict[str, Any]:
        """knittrans' step, all in its clock: scan the stores' new metadata, plan the step's groups ``gids``
        (``assignment`` "links" over the home-placed copies, "tokens" over the hash-placed ones), send each rank
        its plan; each rank DoGets its own slices."""
        import ray

        t0 = time.perf_counter()
        frame = self.knit_readers[assignment].scan_new()
        mine = frame.filter(pl.col("group_id").is_in(gids))
        links = self.link_model if assignment == "links" else None
        per_rank = step_specs(plan_step(mine, w, assignment, links), w.mini_batches, w.ranks)[0]
        planned = time.perf_counter() - t0
        recs = ray.get([r.knit_step.remote(per_rank[j], self.spec["ms_per_ktok"], w.multimodal)
                        for j, r in enumerate(self.ranks)])
        return {"transfer_s": planned + max(r["fetch_s"] for r in recs), "plan_s": planned, "ranks": recs,
                "per_rank": per_rank, "scan_bytes": int(frame.estimated_size())}

    def calibrate(self) -> dict[str, Any]:
        """:func:`bench.cluster.calibrate.calibrate` on this cluster; the readers then past its metadata."""
        out = calibrate(self)
        for reader in (self.peer_reader, *self.knit_readers.values()):
            reader.scan_new()
        return out

    def close(self) -> None:
        import ray
        import transfer_queue as tq

        for reader in (self.peer_reader, *self.knit_readers.values(), self.client):
            reader.close()
        tq.close()
        ray.shutdown()


def _indexed(micros: list[MicroSpec]) -> list[MicroSpec]:
    return [{**m, "index": i} for i, m in enumerate(micros)]


def _take_turns(steppers: dict[str, Callable[[], dict[str, Any]]], s: int) -> dict[str, dict[str, Any]]:
    """Step ``s`` of every path, the paths taking turns in an order that rotates with ``s``; each record with its
    clock (``step_s``), its wall-clock window (``t0``, ``t1``) and the driver host's link bytes."""
    names = list(steppers)
    k = s % len(names)
    out = {}
    for name in names[k:] + names[:k]:
        time.sleep(QUIET_S)  # no other path's bytes in the samples that enclose this step
        rx0, tx0 = _link()
        t0, p0 = time.time(), time.perf_counter()
        rec = steppers[name]()
        rec.update(step_s=time.perf_counter() - p0, t0=t0, t1=time.time())
        rx1, tx1 = _link()
        rec.update(driver_rx=rx1 - rx0, driver_tx=tx1 - tx0,
                   micro_batches=max(r["micro_batches"] for r in rec["ranks"]),
                   rank_bytes=[r["bytes"] for r in rec["ranks"]], tokens=sum(r["tokens"] for r in rec["ranks"]))
        out[name] = rec
        log.info("step %d %s: %.2f s (transfer %.3f s)", s, name, rec["step_s"], rec["transfer_s"])
    time.sleep(QUIET_S)
    return out


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s driver %(levelname)s %(message)s")
    spec = json.loads(Path(argv[0]).read_text())
    driver = Driver(spec)
    try:
        raw = {"calibration": driver.calibrate(),
               "workloads": {kind: driver.workload(kind, Workload(**w)) for kind, w in spec["workloads"].items()}}
    finally:
        driver.close()
    Path(argv[1]).write_text(json.dumps(raw, default=_jsonable))
    return 0


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    msg = f"not JSON: {type(x)}"
    raise TypeError(msg)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
