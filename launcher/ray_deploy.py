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

The configs are the ones ``knit run`` hands its children (``launcher.run.store_configs``, ``train_config``,
``rollout_config``). The driver (this process) holds actor handles, configs and metadata only: it polls the
stores' ``stats``, collects their metadata at the end, and gets small reports back from the actors; trajectory
payload moves from the node that stores it to the rank that trains on it. :func:`run_on_ray` returns the
summary ``knit run`` writes (``launcher.report.policy_summary``) plus ``ray`` (nodes, placement, the bytes the
driver received from actors and stores, none of it payload).

The run folder (``RunConfig.out``) must be on a filesystem every node sees, as for ``knit run`` across hosts:
rank 0 writes the consumed log and progress there, the stores their spill logs.

A store actor that dies while its Ray node lives is started again there from its spill log (``launcher.ray_stores``).
Losing a Ray node (its raylet stops, or it becomes unreachable) is not recovered: its store's groups and its trainer
rank (whose gloo group cannot continue without it) are gone. The driver notices it (an actor there fails, or Ray
marks the node dead), stops every other actor, saves what the surviving stores hold (``metadata.parquet``,
``store_stats.json``) and the accounting (``lost_node.json``: the node, what ran there, the groups it still held when
last polled, lost unconsumed), and raises :class:`RayNodeLostError` naming the node.

Ray is optional (``pip install knittrans[bench]`` ships it) and imported only here, only when called.

Example:
    >>> cfg = RunConfig(train_batches=2, out=Path("runs/ray"))  # doctest: +SKIP
    >>> run_on_ray(cfg, prepare_model(cfg.model_path, model=cfg.model), address="10.0.0.1:6379")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from flight_store.config import ClusterMember, ServerConfig
from flight_store.net import free_port, free_ports
from flight_store.reading import StoreReader
from launcher import report, resume
from launcher.placement import Placement, Site
from launcher.progress import LiveState
from launcher.ray_stores import RayStoreRestartError, RayStores
from launcher.run import Interrupted, RunConfig, rollout_config, store_configs, train_config
from schemas import documents
from schemas.replies import NodeStats
from train.config import ModelConfig

log = logging.getLogger(__name__)

Engine = Literal["vllm", "fake"]


class RayUnavailableError(ImportError):
    """Ray is not installed (``pip install knittrans[bench]``, or ``pip install ray``)."""


class RayDeployError(RuntimeError):
    """A component of the deployment failed (not because its node was lost); names the component and its node."""


class RayNodeLostError(RuntimeError):
    """A Ray node the run used was lost; names the node (IP and Ray id) and what ran on it.

    Attributes: ``node_ip``, ``node_id``, ``components`` (e.g. ``["store node1", "trainer rank 1"]``),
    ``accounting`` (what ``lost_node.json`` holds).
    """

    def __init__(self, node_ip: str, node_id: str, components: list[str], accounting: dict[str, Any]) -> None:
        self.node_ip, self.node_id, self.components, self.accounting = node_ip, node_id, components, accounting
        lost = accounting.get("groups_lost_unconsumed")
        super().__init__(f"Ray node {node_ip} ({node_id[:12]}) was lost mid-run with {', '.join(components)}; "
                         f"{lost} unconsumed group(s) it held are lost; the run was stopped")


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        msg = "knit run --ray needs Ray: pip install knittrans[bench] (or pip install ray)"
        raise RayUnavailableError(msg) from exc
    return ray


# ---- the actors (plain classes; ray.remote wraps them when a deployment starts) ------------------------


class StoreNodeActor:
    """One store node in this actor's process, on the node at ``ip``."""

    def __init__(self, ip: str) -> None:
        self.ip = ip
        self.server: Any = None

    def ports(self) -> tuple[int, int]:
        """Two ports free on this node now: the node's and its metrics'."""
        store, metrics = free_ports(2, self.ip)
        return store, metrics

    def start(self, config: ServerConfig) -> str:
        """Serve ``config`` (its RSS held to the budget, as ``knit serve`` does); returns the location."""
        from flight_store.server import StoreServer

        self.server = StoreServer(replace(config, store=replace(config.store, rss_guard=True)))
        return str(self.server.location)

    def serve(self) -> None:
        """Return when the node stops (the driver holds this call: the actor's death is its error)."""
        self.server.wait()

    def stop(self) -> bool:
        """Stop serving; whether it stopped cleanly."""
        return bool(self.server.shutdown()) if self.server is not None else True


class RolloutActor:
    """The rollout worker (``connectors.rollout.run_rollout``)."""

    def run(self, config: Any, engine: Engine) -> dict[str, Any]:
        """Run until ``config.max_groups`` groups are written; the report without ``write_times``."""
        from connectors.rollout import run_rollout

        fake = None
        if engine == "fake":
            from connectors.fake_engine import FakeEngine
            fake = FakeEngine(seed=config.seed)
        out = run_rollout(config, engine=fake).to_dict()
        return {k: v for k, v in out.items() if k != "write_times"}


class TrainerRankActor:
    """One trainer rank (``train.launch.launch`` under a torch.distributed environment)."""

    def __init__(self, ip: str) -> None:
        self.ip = ip

    def rendezvous_port(self) -> int:
        """A port free on this node (rank 0's rendezvous)."""
        return free_port(self.ip)

    def run(self, cfg: Any, env: dict[str, str]) -> int:
        """Join the group ``env`` describes and train; returns the rank."""
        from train.launch import launch

        ifname = interface_of(self.ip)
        os.environ.update(env)
        if ifname is not None and "GLOO_SOCKET_IFNAME" not in env:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname  # gloo would bind the hostname's address otherwise
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{env['RANK']}] %(name)s %(message)s")
        launch(cfg, 1)
        return int(env["RANK"])


def interface_of(ip: str) -> str | None:
    """The network interface that holds ``ip`` here (None when none does or psutil is missing)."""
    try:
        import psutil
    except ImportError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return str(name)
    return None


def local_ip_towards(address: str) -> str:
    """This machine's IP on the route to ``host:port`` (the driver's node IP for ``ray.init``)."""
    host = address.rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: no packet is sent
        return str(s.getsockname()[0])


# ---- the deployment ------------------------------------------------------------------------------


@dataclass(slots=True)
class Component:
    name: str
    """``store node{i}``, ``rollout``, ``trainer rank {r}``."""
    node_id: str
    node_ip: str
    actor: Any
    ref: Any = None
    """The actor's running call (rollout, trainer ranks)."""


@dataclass(slots=True)
class Deployment:
    """What the driver holds: handles, node ids and addresses, configs; nothing of the payload."""

    nodes: list[dict[str, Any]]
    stores: list[Component] = field(default_factory=list)
    rollout: Component | None = None
    ranks: list[Component] = field(default_factory=list)
    locations: list[str] = field(default_factory=list)
    keeper: RayStores | None = None  # keeps the store actors up
    driver_bytes: dict[str, int] = field(default_factory=lambda: {"actor_returns": 0, "metadata": 0, "stats": 0})

    @property
    def components(self) -> list[Component]:
        return [*self.stores, *([self.rollout] if self.rollout else []), *self.ranks]

    def on(self, node_id: str) -> list[str]:
        return [c.name for c in self.components if c.node_id == node_id]


def run_on_ray(cfg: RunConfig, model: ModelConfig, *, address: str = "auto", engine: Engine = "vllm",
               stop: threading.Event | None = None, on_update: Callable[[LiveState], None] | None = None,
               cpus_per_actor: float = 0.5, node_loss_grace_s: float = 30.0, min_nodes: int = 1,
               wait_nodes_s: float = 60.0) -> dict[str, Any]:
    """Run one policy on the Ray cluster at ``address`` (``auto``: the one this machine belongs to).

    The stores get ``cfg.num_stores``-independent placement: one per Ray node with CPUs. ``engine="fake"`` runs
    the rollout on ``connectors.fake_engine.FakeEngine`` (no vLLM; tests). ``cpus_per_actor``: the CPU slots
    each actor holds. ``node_loss_grace_s``: how long, after a component failed, the driver waits for Ray to
    say whether its node died (then :class:`RayNodeLostError`, else :class:`RayDeployError`). ``min_nodes``: wait
    up to ``wait_nodes_s`` for that many alive nodes with CPUs (nodes still joining).

    Raises:
        RayUnavailableError: Ray is not installed.
        RayNodeLostError: a node the run used was lost (the run is stopped; see the module docstring).
        RayDeployError: a component failed, or the cluster has no node with CPUs.
        TimeoutError: the run exceeded ``cfg.timeout_s``.
        Interrupted: ``stop`` was set.
    """
    ray = _ray()
    stop = stop or threading.Event()
    if not ray.is_initialized():
        kw = {} if address == "auto" else {"_node_ip_address": local_ip_towards(address)}
        ray.init(address=address, log_to_driver=False, **kw)
    deadline = time.monotonic() + wait_nodes_s
    while True:
        nodes = sorted((n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0),
                       key=lambda n: socket.inet_aton(n["NodeManagerAddress"]))
        if len(nodes) >= min_nodes:
            break
        if time.monotonic() > deadline:
            msg = f"the Ray cluster at {address} has {len(nodes)} alive node(s) with CPUs after {wait_nodes_s} s, " \
                  f"min_nodes={min_nodes}"
            raise RayDeployError(msg)
        time.sleep(0.5)
    cfg = replace(cfg, num_stores=len(nodes))
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "lost_node.json").unlink(missing_ok=True)
    resume.fresh(cfg.out)  # an earlier run's progress, event logs and checkpoints
    dep = Deployment(nodes=[{"id": n["NodeID"], "ip": n["NodeManagerAddress"]} for n in nodes])
    state = LiveState()
    t0 = time.time()
    try:
        _start(ray, dep, cfg, model, engine, cpus_per_actor)
        with StoreReader(dep.locations, timeout=5.0) as client:
            _supervise(ray, dep, cfg, client, state, stop, on_update, node_loss_grace_s)
        _collect(dep, cfg, partial=False)
    finally:
        _stop_all(ray, dep)
    result = report.policy_summary(cfg.out, config=json.loads(documents.dump(cfg)) | {
        "lookahead_groups": cfg.lookahead_groups}, wall_s=time.time() - t0, metrics_urls=[],
        outages=[o.to_dict() for o in dep.keeper.outages] if dep.keeper else [])
    result["ray"] = {"nodes": dep.nodes, "placement": {c.name: c.node_ip for c in dep.components},
                     "driver_bytes": dep.driver_bytes}
    (cfg.out / "policy_summary.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def _pinned(ray: Any, cls: type, node_id: str, cpus: float) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    return ray.remote(cls).options(num_cpus=cpus, max_restarts=0, max_concurrency=2 if cls is StoreNodeActor else 1,
                                   scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))


def _start(ray: Any, dep: Deployment, cfg: RunConfig, model: ModelConfig, engine: Engine, cpus: float) -> None:
    """Stores first (ports asked of each node, then the configs ``knit run`` builds, with those ports), then the
    trainer ranks and the rollout."""
    for i, n in enumerate(dep.nodes):
        actor = _pinned(ray, StoreNodeActor, n["id"], cpus).remote(n["ip"])
        dep.stores.append(Component(f"store node{i}", n["id"], n["ip"], actor))
    ports = ray.get([s.actor.ports.remote() for s in dep.stores], timeout=120)
    sites = [Site(address=s.node_ip, exec_prefix=["ray"], name=s.node_ip) for s in dep.stores]
    configs = store_configs(cfg, Placement(stores=sites, rollout=sites[0], trainer=[sites[0]]))
    cluster = [ClusterMember(id=f"node{i}", location=f"grpc://{s.url_host}:{p}")
               for i, (s, (p, _)) in enumerate(zip(sites, ports, strict=True))]
    configs = [replace(c, port=p, metrics_port=m if c.metrics_port is not None else None, cluster=cluster)
               for c, (p, m) in zip(configs, ports, strict=True)]
    dep.locations = ray.get([s.actor.start.remote(c) for s, c in zip(dep.stores, configs, strict=True)], timeout=120)
    for s in dep.stores:
        s.ref = s.actor.serve.remote()
    dep.keeper = RayStores(ray, lambda node, ip: _pinned(ray, StoreNodeActor, node, cpus).remote(ip), configs,
                           dep.locations, max_restarts=cfg.max_store_restarts, start_timeout_s=30.0)
    log.info("store nodes on %s", dict(zip([s.node_ip for s in dep.stores], dep.locations, strict=True)))

    train_cfg = train_config(cfg, model, dep.locations)
    documents.write(train_cfg, cfg.out / "configs" / "train.json")  # what ran, for the record
    world = cfg.admission.dp_ranks
    for r in range(world):
        n = dep.nodes[r % len(dep.nodes)]
        actor = _pinned(ray, TrainerRankActor, n["id"], cpus).remote(n["ip"])
        dep.ranks.append(Component(f"trainer rank {r}", n["id"], n["ip"], actor))
    master = dep.ranks[0]
    port = ray.get(master.actor.rendezvous_port.remote(), timeout=120)
    for r, c in enumerate(dep.ranks):
        env = {"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": master.node_ip, "MASTER_PORT": str(port)}
        c.ref = c.actor.run.remote(train_cfg, env)

    roll_cfg = rollout_config(cfg, dep.locations)
    documents.write(roll_cfg, cfg.out / "configs" / "rollout.json")
    n = dep.nodes[-1]
    dep.rollout = Component("rollout", n["id"], n["ip"], _pinned(ray, RolloutActor, n["id"], cpus).remote())
    dep.rollout.ref = dep.rollout.actor.run.remote(roll_cfg, engine)


def _supervise(ray: Any, dep: Deployment, cfg: RunConfig, client: StoreReader, state: LiveState,
               stop: threading.Event, on_update: Callable[[LiveState], None] | None, grace_s: float) -> None:
    """Follow the run until every trainer rank returned; on a failure, tell a lost node from a failed component."""
    deadline = time.monotonic() + cfg.timeout_s
    last_stats: dict[str, NodeStats] = {}
    pending = {c.ref: c for c in [*dep.ranks, dep.rollout, *dep.stores] if c is not None}
    next_check = 0.0
    while any(c.ref in pending for c in dep.ranks):
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
        for ref in ready:
            comp = pending.pop(ref)
            try:
                value = ray.get(ref)
                dep.driver_bytes["actor_returns"] += len(pickle.dumps(value))
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
                _raise_lost(dep, cfg, lost, last_stats, cause="Ray marked the node dead")
        with contextlib.suppress(Exception):  # a slow or lost node: the checks above decide
            stats = client.stats()
            dep.driver_bytes["stats"] += sum(len(s.to_bytes()) for s in stats.values())
            last_stats.update(stats)
            state.read_stats(stats)
        state.read_progress(cfg.out / "progress.jsonl")
        if on_update:
            on_update(state)
    if dep.rollout is not None and dep.rollout.ref in pending:  # it wrote every group: it ends on its own
        with contextlib.suppress(Exception):
            dep.driver_bytes["actor_returns"] += len(pickle.dumps(ray.get(dep.rollout.ref, timeout=60)))


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


def _lost_node(ray: Any, dep: Deployment) -> dict[str, Any] | None:
    used = {c.node_id for c in dep.components}
    return next((n for n in ray.nodes() if n["NodeID"] in used and not n["Alive"]), None)


def _failed(ray: Any, dep: Deployment, cfg: RunConfig, comp: Component, exc: Exception,
            last_stats: dict[str, NodeStats], grace_s: float) -> None:
    """A component's call failed: a lost node if Ray marks one of ours dead within ``grace_s``, else that component."""
    log.warning("%s on %s failed (%s); asking Ray whether a node was lost", comp.name, comp.node_ip, type(exc).__name__)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        lost = _lost_node(ray, dep)
        if lost is not None:
            _raise_lost(dep, cfg, lost, last_stats, cause=f"{comp.name} failed: {type(exc).__name__}")
        time.sleep(0.5)
    msg = f"{comp.name} on Ray node {comp.node_ip} failed: {exc}"
    raise RayDeployError(msg) from exc


def _raise_lost(dep: Deployment, cfg: RunConfig, node: dict[str, Any], last_stats: dict[str, NodeStats],
                *, cause: str) -> None:
    """Account for the lost node, save what the surviving stores hold, raise :class:`RayNodeLostError`."""
    ip, node_id = node["NodeManagerAddress"], node["NodeID"]
    lost_locations = [loc for s, loc in zip(dep.stores, dep.locations, strict=True) if s.node_id == node_id]
    held = [last_stats[loc].groups for loc in lost_locations if loc in last_stats]
    accounting = {
        "node_ip": ip, "node_id": node_id, "components": dep.on(node_id), "detected_at": time.time(), "cause": cause,
        "stores_lost": lost_locations,
        "groups_lost_unconsumed": sum(g.stored for g in held),
        "groups_released_before_loss": sum(g.released for g in held),
        "reason": "the node's store held them in memory and its spill log is on that node; not trained",
    }
    for c in dep.components:  # stop the rest now: a rank waiting on a lost peer would wait for its gloo timeout
        if c.node_id != node_id and not c.name.startswith("store"):
            with contextlib.suppress(Exception):
                _ray().kill(c.actor)
    with contextlib.suppress(Exception):
        _collect(dep, cfg, partial=True, skip=set(lost_locations))
    (cfg.out / "lost_node.json").write_text(json.dumps(accounting, indent=1))
    raise RayNodeLostError(ip, node_id, accounting["components"], accounting)


def _collect(dep: Deployment, cfg: RunConfig, *, partial: bool, skip: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    """The stores' metadata and counters into the run folder (metadata columns only: never payload)."""
    locations = [loc for loc in dep.locations if loc not in skip]
    with StoreReader(locations, timeout=30.0, retries=3 if partial else 20) as client:
        metadata = client.scan_metadata(partial=partial)
        stats = client.stats()
    dep.driver_bytes["metadata"] += int(metadata.estimated_size())
    metadata.write_parquet(cfg.out / "metadata.parquet")
    (cfg.out / "store_stats.json").write_text(json.dumps({n: s.model_dump(by_alias=True) for n, s in stats.items()},
                                                          indent=1))


def _stop_all(ray: Any, dep: Deployment) -> None:
    """Trainer ranks and the rollout killed, stores stopped (then killed): nothing of the run outlives it."""
    for c in [*dep.ranks, *([dep.rollout] if dep.rollout else [])]:
        with contextlib.suppress(Exception):
            ray.kill(c.actor)
    stops = []
    for s in dep.stores:
        with contextlib.suppress(Exception):
            stops.append(s.actor.stop.remote())
    with contextlib.suppress(Exception):
        ray.wait(stops, num_returns=len(stops), timeout=15)
    for s in dep.stores:
        with contextlib.suppress(Exception):
            ray.kill(s.actor)
    if dep.keeper is not None:
        dep.keeper.close()

