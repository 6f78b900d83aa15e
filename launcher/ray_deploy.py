"""``knit run --ray [ADDRESS]``: the same RL loop deployed on a Ray cluster the stack already owns.

What runs where (each an actor pinned to its Ray node with ``NodeAffinitySchedulingStrategy``, never moved):

* one store node per Ray node that offers CPUs (:class:`StoreNodeActor`): a ``flight_store.StoreServer`` in
  the actor's process, bound to and advertising its node's IP on a port free on that node, with the
  cluster's membership, a spill log and Prometheus ``/metrics`` as in ``knit run``. A node started with
  ``--num-cpus 0`` (a head kept for the GCS and the driver) gets none;
* the rollout worker (:class:`RolloutActor`): ``connectors.rollout.run_rollout``, vLLM or the fake engine;
* the trainer ranks (:class:`TrainerRankActor`), rank ``r`` on the ``r``-th node (round robin): each runs
  ``train.launch.launch`` as one rank of a torch.distributed (gloo) group with ``MASTER_ADDR`` = rank 0's node
  IP, ``MASTER_PORT`` free there, and ``GLOO_SOCKET_IFNAME`` = the interface that holds the node's IP.

The configs are the ones ``knit run`` hands its children (``launcher.run_config.store_configs``, ``train_config``,
``rollout_config``). The driver (this process) holds actor handles, configs and metadata only: it polls the
stores' ``stats``, collects their metadata at the end, and gets small reports back from the actors; trajectory
payload moves from the node that stores it to the rank that trains on it. :func:`run_on_ray` returns the
summary ``knit run`` writes (``launcher.report.policy_summary``) plus ``ray`` (nodes, placement, the bytes the
driver received from actors and stores, none of it payload).

The run folder (``RunConfig.out``) must be on a filesystem every node sees, as for ``knit run`` across hosts:
rank 0 writes the consumed log and progress there, the stores their spill logs.

A store actor that dies while its Ray node lives is started again there from its spill log (``launcher.ray_stores``).
A Ray node lost for good (its raylet stops, or it becomes unreachable: an actor there fails and Ray marks the node
dead, or Ray marks it dead first) is handled as ``knit run`` handles a store node lost for good: its stores leave the
cluster view for good, the driver kills the trainer ranks and the rollout and takes the run up again from the last
checkpoint on the nodes left (``launcher.resume``), the groups written there and not trained regenerated
(``node_lost`` in the ledger); a rollout that fails on a live node is taken up the same way (``rollout_lost``). A
node that held a trainer rank (its gloo group cannot go on without it), or the last store, stops the run: the driver
saves what the surviving stores hold (``metadata.parquet``, ``store_stats.json``) and the accounting
(``lost_node.json``) and raises :class:`RayNodeLostError`; ``knit run --resume RUN_DIR --ray`` takes it up on the
nodes there are then. After the last step nothing stops the run: a node lost then is left out of the final metadata
(:func:`_final_metadata`).

Ray is optional (``pip install knittrans[bench]`` ships it) and imported only here, only when called.

Example::

    cfg = RunConfig(train_batches=2, out=Path("runs/ray"))
    run_on_ray(cfg, prepare_model(cfg.model_path, model=cfg.model), address="10.0.0.1:6379")
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import pickle
import shutil
import socket
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

import polars as pl

from flight_store.config import ClusterMember
from flight_store.reading import StoreReader
from launcher import report, resume
from launcher.placement import Placement, Site
from launcher.progress import LiveState
from launcher.ray_actors import Engine, RolloutActor, StoreNodeActor, TrainerRankActor, local_ip_towards, pinned
from launcher.ray_deployment import (
    Component,
    Deployment,
    RayDeployError,
    RayNode,
    RayNodeLostError,
    RayUnavailableError,
)
from launcher.ray_stores import RayStoreRestartError, RayStores
from launcher.run import Interrupted, WorkerLost
from launcher.run_config import RunConfig, rollout_config, store_configs, train_config
from schemas import documents, run_folder
from schemas.replies import NodeStats
from schemas.run_summary import PolicySummary, RayFigures
from train.config import ModelConfig

__all__ = ["RayDeployError", "RayNodeLostError", "RayUnavailableError", "run_on_ray"]

log = logging.getLogger(__name__)


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        msg = "knit run --ray needs Ray: pip install knittrans[bench] (or pip install ray)"
        raise RayUnavailableError(msg) from exc
    return ray


class _WorkersLost(WorkerLost):
    """A node without a trainer rank was lost for good (``node``), or the rollout failed on a live node: take the run
    up again from the last checkpoint."""

    def __init__(self, cause: str, detail: str, node: RayNode | None = None) -> None:
        super().__init__(cause, detail)
        self.node = node


def run_on_ray(cfg: RunConfig, model: ModelConfig, *, address: str = "auto", engine: Engine = "vllm",
               stop: threading.Event | None = None, on_update: Callable[[LiveState], None] | None = None,
               cpus_per_actor: float = 0.5, node_loss_grace_s: float = 30.0, min_nodes: int = 1,
               wait_nodes_s: float = 60.0, resumed: resume.Resumption | None = None) -> PolicySummary:
    """Run one policy on the Ray cluster at ``address`` (``auto``: the one this machine belongs to).

    The stores get ``cfg.num_stores``-independent placement: one per Ray node with CPUs. ``engine="fake"`` runs
    the rollout on ``connectors.fake_engine.FakeEngine`` (no vLLM; tests). ``cpus_per_actor``: the CPU slots
    each actor holds. ``node_loss_grace_s``: how long, after a component failed, the driver waits for Ray to
    say whether its node died. ``min_nodes``: wait up to ``wait_nodes_s`` for that many alive nodes with CPUs
    (nodes still joining). ``resumed``: take the run stopped in ``cfg.out`` up again (:func:`launcher.resume.begin`;
    its stores start on their spill logs, a store of the earlier run with no node now counts as lost).

    Raises:
        RayUnavailableError: Ray is not installed.
        RayNodeLostError: a node holding a trainer rank (or every store) was lost (the run is stopped, resumable).
        RayDeployError: a component failed, or the cluster has no node with CPUs.
        TimeoutError: the run exceeded ``cfg.timeout_s``.
        Interrupted: ``stop`` was set.
    """
    ray = _ray()
    stop = stop or threading.Event()
    if not ray.is_initialized():
        kw = {} if address == "auto" else {"_node_ip_address": local_ip_towards(address)}
        ray.init(address=address, log_to_driver=False, **kw)
    nodes = _alive_nodes(ray, address, min_nodes, wait_nodes_s)
    earlier, cfg = cfg.num_stores, replace(cfg, num_stores=len(nodes))
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "lost_node.json").unlink(missing_ok=True)
    if resumed is None:
        resume.fresh(cfg.out)  # an earlier run's progress, event logs and checkpoints
        shutil.rmtree(cfg.out / "stores", ignore_errors=True)  # and its spill logs
    else:
        resume.note_gone(cfg.out, range(len(nodes), earlier))
    run_folder.write_run_config(cfg, cfg.out / run_folder.RUN_CONFIG)
    dep = Deployment(nodes=nodes)
    state = LiveState()
    t0 = time.time()
    try:
        _start_stores(ray, dep, cfg, cpus_per_actor)
        cause, rollout_restarts = "stopped", 0
        while True:  # a life: the trainer ranks and the rollout, until the run ends or the rollout is lost
            try:
                _life(ray, dep, cfg, model, (engine, cpus_per_actor), resumed, cause, state, stop, on_update,
                      node_loss_grace_s)
                break
            except _WorkersLost as lost:
                cause, rollout_restarts = lost.cause, lost.count(cfg, rollout_restarts)
                _stop_workers(ray, dep)
                if lost.node is not None:
                    _forget(dep, lost.node)
                resumed = resume.begin(cfg.out)
                state.steps.clear()  # progress.jsonl is cut back to the steps the checkpoint holds
        metadata = _final_metadata(ray, dep, cfg, node_loss_grace_s)
    finally:
        _stop_all(ray, dep)
    resume_figures = resume.finish(cfg.out, metadata)  # the lives' per-step files joined first
    result = report.policy_summary(cfg.out, config=json.loads(documents.dump(cfg)) | {
        "lookahead_groups": cfg.lookahead_groups}, wall_s=time.time() - t0, metrics_urls=[],
        outages=[o.record() for o in dep.keeper.outages] if dep.keeper else [])
    ray_figures = RayFigures(nodes=[{"id": n.id, "ip": n.ip} for n in dep.nodes], lost=dep.lost,
                             placement={c.name: c.node_ip for c in dep.components},
                             driver_bytes=dataclasses.asdict(dep.driver_bytes))
    result = result.model_copy(update={**resume_figures, "ray": ray_figures})
    report.write_policy_summary(cfg.out, result)
    return result


def _alive_nodes(ray: Any, address: str, min_nodes: int, wait_s: float) -> list[RayNode]:
    """The alive Ray nodes with CPUs, by IP, once there are ``min_nodes`` of them (waiting up to ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        nodes = sorted((n for n in map(RayNode.of, ray.nodes()) if n.alive and n.cpus > 0),
                       key=lambda n: socket.inet_aton(n.ip))
        if len(nodes) >= min_nodes:
            return nodes
        if time.monotonic() > deadline:
            msg = f"the Ray cluster at {address} has {len(nodes)} alive node(s) with CPUs after {wait_s} s, " \
                  f"min_nodes={min_nodes}"
            raise RayDeployError(msg)
        time.sleep(0.5)


def _start_stores(ray: Any, dep: Deployment, cfg: RunConfig, cpus: float) -> None:
    """One store node per Ray node: ports asked of each node, then the configs ``knit run`` builds, with those ports
    (each written to ``configs/store{i}.json``)."""
    for i, n in enumerate(dep.nodes):
        actor = pinned(ray, StoreNodeActor, n.id, cpus).remote(n.ip)
        dep.stores.append(Component(f"store node{i}", n.id, n.ip, actor))
    ports = ray.get([s.actor.ports.remote() for s in dep.stores], timeout=120)
    sites = [Site(address=s.node_ip, exec_prefix=["ray"], name=s.node_ip) for s in dep.stores]
    configs = store_configs(cfg, Placement(stores=sites, rollout=sites[0], trainer=[sites[0]]))
    cluster = [ClusterMember(id=f"node{i}", location=f"grpc://{s.url_host}:{p}")
               for i, (s, (p, _)) in enumerate(zip(sites, ports, strict=True))]
    configs = [replace(c, port=p, metrics_port=m if c.metrics_port is not None else None, cluster=cluster)
               for c, (p, m) in zip(configs, ports, strict=True)]
    for i, c in enumerate(configs):
        documents.write(c, cfg.out / "configs" / f"store{i}.json")
    dep.locations = ray.get([s.actor.start.remote(c) for s, c in zip(dep.stores, configs, strict=True)], timeout=120)
    for s in dep.stores:
        s.ref = s.actor.serve.remote()
    dep.keeper = RayStores(ray, lambda node, ip: pinned(ray, StoreNodeActor, node, cpus).remote(ip), configs,
                           dep.locations, max_restarts=cfg.max_store_restarts, start_timeout_s=30.0)
    log.info("store nodes on %s", dict(zip([s.node_ip for s in dep.stores], dep.locations, strict=True)))


def _life(ray: Any, dep: Deployment, cfg: RunConfig, model: ModelConfig, how: tuple[Engine, float],
          resumed: resume.Resumption | None, cause: str, state: LiveState, stop: threading.Event,
          on_update: Callable[[LiveState], None] | None, grace_s: float) -> None:
    """Start the trainer ranks (rank ``r`` on the ``r``-th node) and the rollout (on the last node), taking the run
    up again after ``cause`` when ``resumed``, and follow them to the end (:func:`_supervise`)."""
    engine, cpus = how
    world = cfg.admission.dp_ranks
    rank_nodes = [dep.nodes[r % len(dep.nodes)] for r in range(world)]
    store_nodes = [s.node_id for s in dep.stores]
    links = cfg.admission.links.placed(dict(zip(dep.locations, store_nodes, strict=True)),
                                       tuple(n.id for n in rank_nodes))
    home = [loc for loc, node in zip(dep.locations, store_nodes, strict=True) if node == dep.nodes[-1].id]
    train_cfg, roll_cfg = train_config(cfg, model, dep.locations, links), rollout_config(cfg, dep.locations, home)
    if resumed is not None:
        docs = resume.prepare(cfg.out, resumed, cfg.admission, dep.locations, cause=cause)
        train_cfg, roll_cfg = resume.configs(train_cfg, roll_cfg, resumed, docs, f"{cfg.policy}-")
    documents.write(train_cfg, cfg.out / "configs" / "train.json")  # what ran, for the record
    documents.write(roll_cfg, cfg.out / "configs" / "rollout.json")
    if train_cfg.max_steps <= 0:  # none left: a resume of a run stopped after its last checkpoint
        return
    dep.ranks = []
    for r, n in enumerate(rank_nodes):
        actor = pinned(ray, TrainerRankActor, n.id, cpus).remote(n.ip)
        dep.ranks.append(Component(f"trainer rank {r}", n.id, n.ip, actor))
    master = dep.ranks[0]
    port = ray.get(master.actor.rendezvous_port.remote(), timeout=120)
    for r, c in enumerate(dep.ranks):
        env = {"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": master.node_ip, "MASTER_PORT": str(port)}
        c.ref = c.actor.run.remote(train_cfg, env)
    n = dep.nodes[-1]
    dep.rollout = Component("rollout", n.id, n.ip, pinned(ray, RolloutActor, n.id, cpus).remote())
    dep.rollout.ref = dep.rollout.actor.run.remote(roll_cfg, engine)
    with StoreReader(dep.locations, timeout=5.0) as client:
        _supervise(ray, dep, cfg, client, state, stop, on_update, grace_s)


def _supervise(ray: Any, dep: Deployment, cfg: RunConfig, client: StoreReader, state: LiveState,
               stop: threading.Event, on_update: Callable[[LiveState], None] | None, grace_s: float) -> None:
    """Follow the run until every trainer rank returned; on a failure, tell a lost node from a failed component."""
    deadline = time.monotonic() + cfg.timeout_s
    last_stats: dict[str, NodeStats] = {}
    pending = {c.ref: c for c in [*dep.ranks, dep.rollout, *dep.live_stores] if c is not None}
    next_check = 0.0
    while any(c.ref in pending for c in dep.ranks):
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
        for ref in ready:
            comp = pending.pop(ref)
            try:
                value = ray.get(ref)
                dep.driver_bytes.actor_returns += len(pickle.dumps(value))
            except Exception as exc:
                if not _restarted(dep, comp, exc, pending):
                    _failed(ray, dep, cfg, comp, exc, last_stats, grace_s)
        if stop.is_set():
            raise Interrupted
        if time.monotonic() > deadline:
            msg = f"run {cfg.policy} on Ray exceeded {cfg.timeout_s} s"
            raise TimeoutError(msg)
        if time.monotonic() >= next_check:  # a node Ray marked dead, even with no call of ours failing yet
            next_check = time.monotonic() + 1.0
            lost = _lost_node(ray, dep)
            if lost is not None:
                _node_lost(dep, cfg, lost, last_stats, cause="Ray marked the node dead")
        with contextlib.suppress(Exception):  # a slow or lost node: the checks above decide
            stats = client.stats()
            dep.driver_bytes.stats += sum(len(s.to_bytes()) for s in stats.values())
            last_stats.update(stats)
            state.read_stats(stats)
        state.read_progress(cfg.out / run_folder.PROGRESS)
        if on_update:
            on_update(state)
    if dep.rollout is not None and dep.rollout.ref in pending:  # it wrote every group: it ends on its own
        with contextlib.suppress(Exception):
            dep.driver_bytes.actor_returns += len(pickle.dumps(ray.get(dep.rollout.ref, timeout=60)))


def _restarted(dep: Deployment, comp: Component, exc: Exception, pending: dict[Any, Component]) -> bool:
    """A store actor that died is started again on its node (``launcher.ray_stores``); whether it was."""
    if comp not in dep.stores or dep.keeper is None or _lost_node(_ray(), dep) is not None:
        return False
    with contextlib.suppress(RayStoreRestartError):  # not started again: the caller tells a lost node from a failure
        comp.actor = dep.keeper.restart(dep.stores.index(comp), comp.node_id, comp.node_ip, exc)
        comp.ref = comp.actor.serve.remote()
        pending[comp.ref] = comp
        return True
    return False


def _lost_node(ray: Any, dep: Deployment) -> RayNode | None:
    """A node of the run's components that Ray marks dead (and that was not already given up)."""
    used = {c.node_id for c in dep.components} - set(dep.lost)
    return next((n for n in map(RayNode.of, ray.nodes()) if n.id in used and not n.alive), None)


def _failed(ray: Any, dep: Deployment, cfg: RunConfig, comp: Component, exc: Exception,
            last_stats: dict[str, NodeStats], grace_s: float) -> None:
    """A component's call failed: a lost node if Ray marks one of ours dead within ``grace_s``; else the rollout is
    taken up again (:class:`_WorkersLost`), any other component fails the run."""
    log.warning("%s on %s failed (%s); asking Ray whether a node was lost", comp.name, comp.node_ip, type(exc).__name__)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        lost = _lost_node(ray, dep)
        if lost is not None:
            _node_lost(dep, cfg, lost, last_stats, cause=f"{comp.name} failed: {type(exc).__name__}")
        time.sleep(0.5)
    if comp is dep.rollout:
        raise _WorkersLost("rollout_lost", f"the rollout on {comp.node_ip} failed: {exc}") from exc
    msg = f"{comp.name} on Ray node {comp.node_ip} failed: {exc}"
    raise RayDeployError(msg) from exc


def _node_lost(dep: Deployment, cfg: RunConfig, node: RayNode, last_stats: dict[str, NodeStats],
               *, cause: str) -> None:
    """A node of the run is lost for good: its stores' groups not trained will go out again. With a trainer rank on
    it, or no store left, the run stops (:func:`_raise_lost`); else the run is taken up again on the nodes left."""
    node_id = node.id
    _note_stores_lost(dep, cfg, node_id)
    if any(c.node_id == node_id for c in dep.ranks) or all(s.node_id == node_id for s in dep.live_stores):
        _raise_lost(dep, cfg, node, last_stats, cause=cause)
    raise _WorkersLost("node_lost", f"Ray node {node.ip} ({', '.join(dep.on(node_id))}) is lost "
                                    f"for good ({cause})", node)


def _note_stores_lost(dep: Deployment, cfg: RunConfig, node_id: str) -> None:
    """The stores on Ray node ``node_id`` noted lost for good in the run's event log (``launcher.resume``)."""
    for i, s in enumerate(dep.stores):
        if s.node_id == node_id and dep.keeper is not None:
            resume.note_lost(cfg.out, str(dep.keeper.configs[i].node_name), dep.locations[i])


def _forget(dep: Deployment, node: RayNode) -> None:
    """Leave the lost ``node`` out: its stores down in every cluster view from now on, nothing placed on it again."""
    dep.lost.append(node.id)
    dep.nodes = [n for n in dep.nodes if n.id != node.id]
    if dep.keeper is not None:
        dep.keeper.lose([i for i, s in enumerate(dep.stores) if s.node_id == node.id])


def _raise_lost(dep: Deployment, cfg: RunConfig, node: RayNode, last_stats: dict[str, NodeStats],
                *, cause: str) -> None:
    """Account for the lost node, save what the surviving stores hold, raise :class:`RayNodeLostError`."""
    ip, node_id = node.ip, node.id
    lost_locations = [loc for s, loc in zip(dep.stores, dep.locations, strict=True) if s.node_id == node_id]
    held = [last_stats[loc].groups for loc in lost_locations if loc in last_stats]
    accounting = {
        "node_ip": ip, "node_id": node_id, "components": dep.on(node_id), "detected_at": time.time(), "cause": cause,
        "stores_lost": lost_locations,
        "groups_lost_unconsumed": sum(g.stored for g in held),
        "groups_released_before_loss": sum(g.released for g in held),
        "reason": "the node's store held them in memory and its spill log is on that node; not trained",
    }
    _stop_workers(_ray(), dep)  # now: a rank waiting on a lost peer would wait for its gloo timeout
    with contextlib.suppress(Exception):
        _collect(dep, cfg, skip=lost_locations)
    (cfg.out / "lost_node.json").write_text(json.dumps(accounting, indent=1))
    raise RayNodeLostError(ip, node_id, dep.on(node_id), accounting)


def _collect(dep: Deployment, cfg: RunConfig, *, skip: Collection[str] = ()) -> tuple[pl.DataFrame, list[str]]:
    """The metadata and counters of the stores that answer into the run folder (metadata columns only: never
    payload), leaving out the lost nodes' stores and ``skip``; returns the metadata and the stores asked whose metadata
    it lacks (they did not answer, or the cluster's view has them down)."""
    lost = {loc for s, loc in zip(dep.stores, dep.locations, strict=True) if s.node_id in dep.lost}
    locations = [loc for loc in dep.locations if loc not in lost.union(skip)]
    with StoreReader(locations, timeout=30.0, retries=3) as client:
        metadata = client.scan_metadata(partial=True)
        failed = set(client.last_failed_nodes)
        stats = client.stats(partial=True)
    dep.driver_bytes.metadata += int(metadata.estimated_size())
    metadata.write_parquet(cfg.out / run_folder.METADATA)
    (cfg.out / "store_stats.json").write_text(json.dumps({n: s.model_dump(by_alias=True) for n, s in stats.items()},
                                                          indent=1))
    return metadata, [loc for loc in locations if loc in failed or loc not in stats]


def _final_metadata(ray: Any, dep: Deployment, cfg: RunConfig, grace_s: float) -> pl.DataFrame:
    """The stores' metadata once every trainer rank returned (:func:`_collect`).

    Training is over, so nothing that happens now stops the run: a node Ray marks dead is left out for good (its
    stores' groups were trained, or the ledger counts them ``node_lost``), a store actor that ended on a live node is
    started again there from its spill log, and the stores are asked again until every store left answers.

    Raises:
        RayDeployError: a store on a node Ray keeps alive still does not answer ``grace_s`` after the first try (the
            metadata of the others is in the run folder).
    """
    deadline = time.monotonic() + grace_s
    while True:
        last_try = time.monotonic() > deadline  # one whole pass after the deadline: a restart may have taken it
        lost = _lost_node(ray, dep)
        while lost is not None:
            log.warning("Ray node %s (%s) was lost after the last step; its stores are left out of the final metadata",
                        lost.ip, ", ".join(dep.on(lost.id)))
            _note_stores_lost(dep, cfg, lost.id)
            _forget(dep, lost)
            lost = _lost_node(ray, dep)
        for s in dep.live_stores:  # serve() returns only when the store is stopped: one that returned failed
            if s.ref is not None and ray.wait([s.ref], timeout=0)[0]:
                try:
                    ray.get(s.ref)
                    exc: Exception = RuntimeError("the store actor's serve() returned after the last step")
                except Exception as err:
                    exc = err
                _restarted(dep, s, exc, {})
        metadata, missing = _collect(dep, cfg)
        if not missing:
            return metadata
        if last_try:
            msg = (f"store node(s) {missing} did not answer after the last step for {grace_s} s while Ray keeps their "
                   "nodes alive; metadata.parquet holds the other stores' metadata only")
            raise RayDeployError(msg)
        time.sleep(0.5)


def _stop_workers(ray: Any, dep: Deployment) -> None:
    """Kill the trainer ranks and the rollout (a resume takes up what they left: checkpoints, event logs)."""
    for c in [*dep.ranks, *([dep.rollout] if dep.rollout else [])]:
        with contextlib.suppress(Exception):
            ray.kill(c.actor)


def _stop_all(ray: Any, dep: Deployment) -> None:
    """Trainer ranks and the rollout killed, stores stopped (then killed): nothing of the run outlives it."""
    _stop_workers(ray, dep)
    stops = []
    for s in dep.live_stores:
        with contextlib.suppress(Exception):
            stops.append(s.actor.stop.remote())
    with contextlib.suppress(Exception):
        ray.wait(stops, num_returns=len(stops), timeout=15)
    for s in dep.stores:
        with contextlib.suppress(Exception):
            ray.kill(s.actor)
    if dep.keeper is not None:
        dep.keeper.close()
