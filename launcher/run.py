"""``knit run``: the main job, a real disaggregated RL loop on one machine.

What it starts, each as a subprocess in its own process group (``launcher.children``), each with
its config as a validated document (``schemas.documents``), never as re-typed argv:

1. ``num_stores`` store nodes (``python -m flight_store --config node.json``, with Prometheus
   ``/metrics`` and a spill log in ``stores/node{i}``); a node whose process dies is started again on
   the same port and spill log (:class:`Stores`), replays its log and comes back with every
   acknowledged group, while the trainer and the rollout retry their calls; the report lists each
   outage. A node that cannot be brought back is lost for good: the driver stops the trainer and the rollout
   and takes the run up again from the last checkpoint on the nodes left (``launcher.resume``), its groups not
   trained regenerated (``node_lost``); a rollout process that dies is handled the same way (``rollout_lost``);
2. a Megatron-core trainer (``python -m train --config train.json --nproc D``; gloo on CPU), whose
   rank 0 plans with ``admission.Planner`` (``mini_batch`` by default, ``train_batch`` as the
   baseline), publishes its starting weights as version 0 and the weights of every new version, and
   releases consumed groups;
3. a vLLM rollout worker (``python -m connectors --config rollout.json``) on a tiny Llama of exactly
   the trainer's shape (``launcher.model``), which loads the trainer's version-0 weights before it
   generates, loads every newly published version into the running engine, and streams each finished
   prompt group to the stores. The lookahead limit (groups dispatched but not yet consumed) couples
   the two. With ``--engine vllm-server`` the rollout drives a vLLM server over HTTP instead
   (``connectors.served``), the run's own ``vllm serve`` (``engine``, at the rollout's site) unless
   ``--engine-url`` names one; the server pulls each version's weights from the stores itself.

Where each process runs is a :class:`~launcher.placement.Placement` (default: everything on this machine's
loopback); ``launcher.hosts`` places them on hosts of their own (network namespaces), each store node
binding and advertising its host's address, the trainer ranks one per host over torch.distributed.

This driver never imports vLLM or torch and never reads trajectory payload: it polls the stores'
``stats``, follows the trainer's per-step progress file, and at the end writes the run folder
(``launcher.report``): ``summary.json``, ``metadata.parquet``, ``consumed.parquet``, plots.

Lookahead defaults (a fair comparison at matched throughput, docs/design.md): ``train_batch`` needs the
rollout a whole train batch ahead, so its limit is 2B groups; ``mini_batch`` keeps the trainer busy
with B + B/K. Both count the groups running in the engine, so the limit bounds everything
dispatched and not yet consumed.

Example:
    knit run --quick --compare --out runs/compare
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from connectors.served import SERVER_ENV, server_command
from flight_store.net import free_ports
from flight_store.reading import StoreReader
from launcher import report, resume
from launcher.children import Child, Children
from launcher.placement import Placement, Site
from launcher.progress import LiveState
from launcher.run_config import RunConfig, rollout_config, store_configs, train_config
from launcher.stores import Stores
from schemas import documents, run_folder
from schemas.run_summary import PolicySummary
from train.config import ModelConfig

log = logging.getLogger(__name__)


class Interrupted(Exception):
    """Ctrl-C or SIGTERM reached the driver."""


class WorkerLost(Exception):
    """A store node was lost for good (``node_lost``) or the rollout process died (``rollout_lost``): the driver
    stopped the trainer and the rollout and takes the run up again from its checkpoint (``launcher.resume``)."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause

    def count(self, cfg: RunConfig, rollout_restarts: int) -> int:
        """The rollout's restarts with this one counted; raises ``RuntimeError`` past ``cfg.max_rollout_restarts``."""
        rollout_restarts += self.cause == "rollout_lost"
        if rollout_restarts > cfg.max_rollout_restarts:
            msg = f"the rollout died {rollout_restarts} times (max_rollout_restarts): {self}"
            raise RuntimeError(msg) from self
        log.warning("%s: taking the run up again from its last checkpoint", self)
        return rollout_restarts


# ---- one run ----------------------------------------------------------------------------------


def run_policy(cfg: RunConfig, model: ModelConfig, *, stop: threading.Event,
               on_update: Callable[[LiveState], None] | None = None,
               placement: Placement | None = None, resumed: resume.Resumption | None = None) -> PolicySummary:
    """Run one policy end to end; returns the run's results (``launcher.report.policy_summary``).

    ``placement`` says where each process runs (default: :meth:`Placement.local`); ``resumed``: take a stopped
    run in ``cfg.out`` up again (:func:`launcher.resume.begin`)."""
    placement = placement or Placement.local(cfg.num_stores)
    placement.check(num_stores=cfg.num_stores, dp_ranks=cfg.admission.dp_ranks)
    cfg.out.mkdir(parents=True, exist_ok=True)
    if resumed is None:
        resume.fresh(cfg.out)
        run_folder.write_run_config(cfg, cfg.out / run_folder.RUN_CONFIG)
    state = LiveState()  # the display knows the policy and the totals (main_job)
    t0 = time.time()
    with Children(cfg.out / "logs") as kids:
        stores = Stores(kids, store_configs(cfg, placement), cfg.out, max_restarts=cfg.max_store_restarts,
                        start_timeout_s=cfg.store_start_timeout_s, sites=placement.stores, probe_s=placement.probe_s)
        stores.start(fresh=resumed is None)
        locations = stores.locations
        if cfg.engine == "vllm-server" and cfg.engine_url is None:
            cfg = start_engine_server(cfg, kids, placement.rollout, locations, append=resumed is not None)
        try:
            cause, rollout_restarts, noted = "stopped", 0, set()  # noted: the lost nodes in the event log
            while True:  # a life: the trainer and the rollout, until the run ends or a worker is lost
                try:
                    interrupted = _life(cfg, model, kids, stores, placement, resumed, cause, state, stop, on_update)
                    break
                except WorkerLost as lost:
                    cause, rollout_restarts = lost.cause, lost.count(cfg, rollout_restarts)
                    for o in stores.outages:
                        if o.lost_at is not None and o.node not in noted:
                            resume.note_lost(cfg.out, o.node, o.location)
                            noted.add(o.node)
                    resumed = resume.begin(cfg.out)
                    state.steps.clear()  # progress.jsonl is cut back to the steps the checkpoint holds: read it again
            stores.wait_up()  # every node not lost answers: export their metadata, then stop them (Children.__exit__)
        finally:
            stores.close()
        with StoreReader(locations, timeout=30.0, retries=20) as client:  # fresh connections, none in reconnect backoff
            metadata = client.metadata().collect()
            stats = client.stats()
        metadata.write_parquet(cfg.out / run_folder.METADATA)
        resume_figures = resume.finish(cfg.out, metadata)
        (cfg.out / "store_stats.json").write_text(json.dumps({n: s.model_dump(by_alias=True) for n, s in stats.items()},
                                                              indent=1))
    urls = [f"http://{n.advertised_host}:{n.metrics_port}/metrics" for n in stores.nodes if n.metrics_port is not None]
    quotas = [(q.column, n) for q, n in zip(cfg.admission.quotas, cfg.admission.quota_counts(), strict=True)]
    result = report.policy_summary(cfg.out, config=json.loads(documents.dump(cfg)) | {
        "lookahead_groups": cfg.lookahead_groups}, wall_s=time.time() - t0, metrics_urls=urls,
        outages=[o.record() for o in stores.outages], quotas=quotas)
    result = result.model_copy(update={"interrupted": interrupted, **resume_figures})
    report.write_policy_summary(cfg.out, result)
    report.plot_policy(cfg.out, result)
    if interrupted:
        raise Interrupted
    return result


def _life(cfg: RunConfig, model: ModelConfig, kids: Children, stores: Stores, placement: Placement,
          resumed: resume.Resumption | None, cause: str, state: LiveState, stop: threading.Event,
          on_update: Callable[[LiveState], None] | None) -> bool:
    """Start the trainer and the rollout (``resumed``: taking the run up again, after ``cause``) and follow them to
    the end; returns True when interrupted. Raises :class:`WorkerLost` (the workers stopped) as :func:`_supervise`
    does."""
    locations = stores.locations
    state.phase = "starting trainer + vLLM"
    links = placement.link_model(locations, cfg.admission.dp_ranks, cfg.admission.links)
    train_cfg = train_config(cfg, model, locations, links)
    rollout_cfg = rollout_config(cfg, locations, [locations[i] for i in placement.home_stores()])
    if resumed is not None:
        docs = resume.prepare(cfg.out, resumed, cfg.admission, locations, cause=cause)
        train_cfg, rollout_cfg = resume.configs(train_cfg, rollout_cfg, resumed, docs, f"{cfg.policy}-")
    train_doc = documents.write(train_cfg, cfg.out / "configs" / "train.json")
    rollout_doc = documents.write(rollout_cfg, cfg.out / "configs" / "rollout.json")
    if train_cfg.max_steps <= 0:  # none left: a resume of a run stopped after its last checkpoint
        return False
    again = resumed is not None  # the logs of the earlier lives stay, the new one after them
    trainers = start_trainer(kids, placement, train_doc, cfg.admission.dp_ranks, append=again)
    rollout = kids.start("rollout", placement.rollout.command(
        [sys.executable, "-m", "connectors", "--config", str(rollout_doc)]), env=placement.rollout.env, append=again)
    with StoreReader(locations, timeout=5.0) as client:
        return _supervise(cfg, kids, stores, (trainers, rollout), client, state, stop, on_update)


def start_engine_server(cfg: RunConfig, kids: Children, site: Site, locations: list[str], *,
                        append: bool = False) -> RunConfig:
    """Start the run's vLLM server (``engine``) at the rollout's site, on a free port; returns ``cfg`` with its URL.
    The rollout waits for it to answer (``RolloutConfig.engine_start_timeout_s``)."""
    (port,) = free_ports(1, site.address if site.is_local else "127.0.0.1")
    cfg = dataclasses.replace(cfg, engine_url=f"http://{site.url_host}:{port}")
    cmd = server_command(rollout_config(cfg, locations), port, host=site.address)
    kids.start("engine", site.command(cmd), env=site.env | SERVER_ENV, append=append)
    return cfg


def start_trainer(kids: Children, placement: Placement, doc: Path, dp_ranks: int, *,
                  append: bool = False) -> list[Child]:
    """Start the trainer: one process of ``dp_ranks`` local ranks at its site (``trainer``), or one process per
    rank at the rank's site (``trainer{r}``, joined over torch.distributed at ``trainer[0]``'s address)."""
    cmd = [sys.executable, "-m", "train", "--config", str(doc)]
    if not placement.ranks_apart:
        site = placement.trainer[0]
        return [kids.start("trainer", site.command([*cmd, "--nproc", str(dp_ranks)]), env=site.env, append=append)]
    rendezvous = {"WORLD_SIZE": str(dp_ranks), "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0",
                  "MASTER_ADDR": placement.trainer[0].address, "MASTER_PORT": str(placement.master_port)}
    return [kids.start(f"trainer{r}", site.command(cmd), env=site.env | rendezvous | {"RANK": str(r)}, append=append)
            for r, site in enumerate(placement.trainer)]


def _supervise(cfg: RunConfig, kids: Children, stores: Stores, workers: tuple[list[Child], Child],
               client: StoreReader, state: LiveState, stop: threading.Event,
               on_update: Callable[[LiveState], None] | None) -> bool:
    """Follow the run until the trainer exits, restarting a store node that dies; returns True when interrupted.

    Raises when the trainer fails or every store node is lost (:meth:`Stores.check`); raises :class:`WorkerLost`,
    once the trainer and the rollout are stopped, when a store node is lost for good or the rollout process dies.
    """
    trainers, rollout = workers
    served = next((c for c in kids.started if c.name == "engine"), None)  # the run's own engine server, if any
    deadline = time.monotonic() + cfg.timeout_s
    lost_before = len(stores.lost)

    def refresh() -> None:
        try:
            state.read_stats(client.stats())
        except Exception as exc:  # a slow answer is not fatal for a progress display
            log.debug("stats failed: %s", exc)
        state.read_progress(cfg.out / run_folder.PROGRESS)
        if on_update:
            on_update(state)

    try:
        while any([t.alive() for t in trainers]):  # a list: every rank polled, so a failed one has its exit code
            failed = next((t for t in trainers if t.proc.returncode not in (0, None)), None)
            if failed is not None:  # one rank failed: the others would wait for it in a collective
                msg = f"the trainer failed ({failed.name} exit {failed.proc.returncode}):\n{kids.tail(failed, 40)}"
                raise RuntimeError(msg)
            if stop.is_set():
                raise Interrupted
            if time.monotonic() > deadline:
                msg = f"run {cfg.policy} exceeded {cfg.timeout_s} s"
                raise TimeoutError(msg)
            state.stores_down = stores.check()
            if len(stores.lost) > lost_before:
                raise WorkerLost("node_lost", f"store node {stores.lost[-1]} is lost for good")
            refresh()
            if not rollout.alive() and rollout.proc.returncode not in (0, None):
                raise WorkerLost("rollout_lost", f"the rollout worker died (exit {rollout.proc.returncode}):\n"
                                                 f"{kids.tail(rollout)}")
            if served is not None and not served.alive():  # the rollout's engine is gone: nothing can be generated
                msg = f"the engine server died (exit {served.proc.returncode}):\n{kids.tail(served)}"
                raise RuntimeError(msg)
            stop.wait(0.5)
        failed = next((t for t in trainers if t.proc.returncode != 0), None)
        if failed is not None:
            msg = f"the trainer failed ({failed.name} exit {failed.proc.returncode}):\n{kids.tail(failed, 40)}"
            raise RuntimeError(msg)
        state.phase = "finishing"
        refresh()
        kids.stop(rollout, grace_s=30.0)  # all groups were consumed: it has finished or stops now
        return False
    except Interrupted:
        state.phase = "interrupted"
        _stop_workers(kids, trainers, rollout)
        return True
    except WorkerLost:
        state.phase = "taking the run up again"
        _stop_workers(kids, trainers, rollout)
        raise


def _stop_workers(kids: Children, trainers: list[Child], rollout: Child) -> None:
    """Stop the trainer (it ends the step being taken and checkpoints it) and the rollout (it aborts the groups
    still running and writes them)."""
    for t in trainers:
        kids.stop(t, grace_s=30.0)
    kids.stop(rollout, grace_s=15.0)
