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
   the two.

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
from dataclasses import dataclass, field
from pathlib import Path

from admission.config import AdmissionConfig, LinkModel, Policy, Quota
from connectors.config import DEFAULT_DATA_SOURCES, GroupPlacement, RolloutConfig
from flight_store.config import ClusterMember, ServerConfig, StoreConfig
from flight_store.net import free_ports
from flight_store.reading import StoreReader
from launcher import ledger, report, resume
from launcher.children import ROOT, Child, Children
from launcher.model import MODELS_DIR, RUN_MODELS, RunModelName
from launcher.placement import Placement
from launcher.progress import LiveState
from launcher.stores import Stores
from schemas import documents, run_folder
from schemas.run_summary import PolicySummary
from train.config import ModelConfig, ObjectiveConfig, OptimConfig, ParallelConfig, TrainConfig
from train.tracking import TrackingConfig

log = logging.getLogger(__name__)

COMPARED: tuple[Policy, ...] = ("train_batch", "mini_batch", "streaming")
"""The policies ``--compare`` runs, baseline first, the quota-free reference last."""
RUN_POLICIES: tuple[Policy, ...] = (*COMPARED, "colocated")
"""The policies ``knit run`` runs (``colocated``: the rollout generates each train batch with the weights the
trainer starts it from, and waits for them: synchronous, on-policy RL)."""


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


def _default_admission() -> AdmissionConfig:
    """B=8, G=4, K=4 on 2 ranks (one group per rank and step), with the built-in sources' 50/50 mix as each train
    batch's quota. K=4 as in ``bench.staleness`` and the common PPO setting of four mini-batches per train batch."""
    return AdmissionConfig(train_batch_groups=8, group_size=4, mini_batches=4, dp_ranks=2, token_budget=4096,
                           quotas=(Quota(column="data_source", shares=dict(DEFAULT_DATA_SOURCES)),))


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """One ``knit run`` of one policy (``--compare`` runs one per policy, the rest equal).

    Example:
        >>> cfg = RunConfig(train_batches=3, out=Path("runs/x"))
        >>> cfg.lookahead_groups, cfg.steps, cfg.total_groups
        (10, 12, 24)
    """

    admission: AdmissionConfig = field(default_factory=_default_admission)
    """The trainer's planner: B, G, K, D (trainer ranks), token budget, quotas, policy."""
    train_batches: int = 300
    """Train batches to run (the trainer takes ``train_batches * mini_batches`` optimizer steps)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3))
    """The trainer's optimizer."""
    loss: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    """The trainer's policy loss (``--objective``, ``--is-cap``)."""
    partial_rollouts: bool = False
    """New weights interrupt the running samples, which resume under them (``RolloutConfig.partial_rollouts``)."""
    export_hf: bool = False
    """At the end, write the trained weights as an HF checkpoint folder, ``final_hf`` in the run folder (for
    ``bench.task_success --model``, or serving)."""
    max_tokens: int = 64
    """Longest response, tokens."""
    lookahead: int | None = None
    """Groups dispatched but not yet consumed (None = the policy's default: 2B for train_batch, B for colocated,
    B + B/K else)."""
    seed: int = 0
    """Seed of the prompt stream, sampling, the tiny model and the trainer (same seed, same prompts per policy)."""
    data_sources: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_DATA_SOURCES))
    """The rollout's mix of built-in data sources (``connectors.tasks``); a quota on ``data_source`` given as
    shares (the default admission's: half each) follows this mix."""
    reward: str = "digits"
    """Reward: a built-in name (``digits``: shaped, learnable by the tiny model; ``exact``) or module:function."""
    num_stores: int = 2
    """Store nodes to start."""
    placement: GroupPlacement = "local"
    """Where the rollout writes each group: ``local`` on a store node of its own host (the group id names it),
    ``hash`` on the node rendezvous hashing picks (``schemas.routing``)."""
    idle_timeout_s: float = 180.0
    """The trainer stops when no mini-batch becomes admissible for this long (covers vLLM start-up)."""
    timeout_s: float = 900.0
    """The whole run of one policy is stopped after this long."""
    model: RunModelName = "tiny"
    """The model: a tiny random Llama, or SmolLM2-135M-Instruct (then its run defaults: exact reward, 32 tokens,
    B=4 on one rank, 12 train batches, lr 1e-5, bf16 sync; ``launcher.model.RUN_MODELS``)."""
    model_dir: Path | None = None
    """The model's folder, built or converted once, then reused (none: runs/.models/ + the model's own folder)."""
    out: Path = field(default_factory=lambda: ROOT / "runs" / time.strftime("%Y%m%d-%H%M%S"))
    """The run folder."""
    metrics: bool = True
    """Serve Prometheus metrics from each store."""
    max_store_restarts: int = 3
    """Times one store node that dies is started again (same port and spill log) before the run fails."""
    store_start_timeout_s: float = 60.0
    """Seconds a store node may take to answer ``health`` after it was started (or restarted)."""
    checkpoint_every: int = 1
    """Checkpoint the trainer (model and optimizer) after every this many optimizer steps (0: only at the end);
    ``--resume`` takes the run up from the last one (``launcher.resume``)."""
    max_rollout_restarts: int = 3
    """Times the driver takes the run up again after its rollout process died (its prompts in flight go out
    again) before the run fails."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Experiment tracking of each step (the trainer's rank 0 logs it): ``--logger console,tensorboard,wandb,mlflow``,
    writing in the run folder unless ``--tracking-dir`` says otherwise."""

    def __post_init__(self) -> None:
        quotas = self.admission.quotas
        if (len(quotas) == 1 and quotas[0].column == "data_source" and quotas[0].shares is not None
                and dict(quotas[0].shares) != self.data_sources):  # the source quota follows the mix
            self.admission = dataclasses.replace(
                self.admission, quotas=(Quota(column="data_source", shares=dict(self.data_sources)),))
            self.admission.quota_counts()  # B times each share must be a whole number of groups
        if (min(self.max_store_restarts, self.checkpoint_every, self.max_rollout_restarts) < 0
                or self.store_start_timeout_s <= 0):
            msg = (f"RunConfig: max_store_restarts={self.max_store_restarts}, checkpoint_every="
                   f"{self.checkpoint_every} and max_rollout_restarts={self.max_rollout_restarts} must be >= 0, "
                   f"store_start_timeout_s={self.store_start_timeout_s} > 0")
            raise ValueError(msg)
        for name in ("train_batches", "max_tokens", "num_stores"):
            if getattr(self, name) < 1:
                msg = f"RunConfig.{name}={getattr(self, name)} must be >= 1"
                raise ValueError(msg)
        if self.admission.policy not in RUN_POLICIES:
            msg = f"RunConfig: knit run runs the policies {RUN_POLICIES}, not {self.admission.policy!r}"
            raise ValueError(msg)
        per_mini = self.admission.groups_per_mini_batch
        if self.lookahead is not None and self.lookahead < per_mini:
            msg = f"RunConfig.lookahead={self.lookahead} is below one mini-batch ({per_mini} groups)"
            raise ValueError(msg)

    @property
    def model_path(self) -> Path:
        """The folder the rollout serves (and the trainer's ``hf_checkpoint`` for a pretrained model)."""
        return self.model_dir if self.model_dir is not None else MODELS_DIR / RUN_MODELS[self.model].folder

    @property
    def policy(self) -> str:
        return self.admission.policy

    @property
    def lookahead_groups(self) -> int:
        """The lookahead limit in effect: 2B for ``train_batch``, B for ``colocated``, B + B/K else, unless set."""
        if self.lookahead is not None:
            return self.lookahead
        b = self.admission.train_batch_groups
        if self.policy == "colocated":
            return b
        return 2 * b if self.policy == "train_batch" else b + self.admission.groups_per_mini_batch

    @property
    def steps(self) -> int:
        """Optimizer steps the trainer takes."""
        return self.train_batches * self.admission.mini_batches

    @property
    def total_groups(self) -> int:
        """Prompt groups the rollout generates (exactly what the trainer consumes)."""
        return self.train_batches * self.admission.train_batch_groups

    def for_policy(self, policy: Policy, out: Path) -> RunConfig:
        """The same run with another policy, in ``out``."""
        return dataclasses.replace(self, admission=dataclasses.replace(self.admission, policy=policy), out=out)


# ---- the configs of the children ---------------------------------------------------------------


def store_configs(cfg: RunConfig, placement: Placement | None = None) -> list[ServerConfig]:
    """One node config per store: bound to and advertising its site's address (loopback by default) on a free
    port, metrics on a free port when asked, the cluster's membership (so every node refuses a group routing
    gives another), and a spill directory in the run folder (``stores/node{i}``: every acknowledged write is
    logged, so a node started again replays it)."""
    sites = (placement or Placement.local(cfg.num_stores)).stores
    # the ports are asked of each site's address here, or (a site elsewhere, e.g. a fresh network namespace, where
    # nothing listens yet) of this machine's loopback; all of one address at once, so no two nodes share one
    asked = [s.address if s.is_local else "127.0.0.1" for s in sites]
    per_site = 2 if cfg.metrics else 1
    free = {host: iter(free_ports(per_site * asked.count(host), host)) for host in dict.fromkeys(asked)}
    ports = [(next(free[host]), next(free[host]) if cfg.metrics else None) for host in asked]
    cluster = [ClusterMember(id=f"node{i}", location=f"grpc://{s.url_host}:{port}")
               for i, (s, (port, _)) in enumerate(zip(sites, ports, strict=True))]
    return [ServerConfig(host=s.address, port=port, node_name=f"node{i}", log_level="WARNING", cluster=cluster,
                         metrics_port=metrics, store=StoreConfig(spill_dir=str(cfg.out / "stores" / f"node{i}")))
            for i, (s, (port, metrics)) in enumerate(zip(sites, ports, strict=True))]


def train_config(cfg: RunConfig, model: ModelConfig, stores: list[str], links: LinkModel | None = None) -> TrainConfig:
    """The trainer's config: the run's admission (with the hosts of the nodes and ranks, ``links``) and optimizer,
    publishing weights, reports and tracking in the run folder."""
    admission = cfg.admission if links is None else dataclasses.replace(cfg.admission, links=links)
    return TrainConfig(
        stores=stores, model=model, admission=admission, optim=cfg.optim, loss=cfg.loss,
        parallel=ParallelConfig(backend="gloo", timeout_s=max(600.0, 2 * cfg.idle_timeout_s)),
        publish_weights=True, publish_dtype=RUN_MODELS[cfg.model].publish_dtype, max_steps=cfg.steps,
        idle_timeout_s=cfg.idle_timeout_s, seed=cfg.seed,
        report_path=str(cfg.out / "trainer_rank{rank}.json"), progress_path=str(cfg.out / run_folder.PROGRESS),
        consumed_path=str(cfg.out / run_folder.CONSUMED), checkpoint_dir=str(cfg.out / resume.CHECKPOINTS),
        checkpoint_every=cfg.checkpoint_every, trained_path=str(cfg.out / ledger.EVENTS / ledger.TRAINED_EVENTS),
        export_hf_dir=str(cfg.out / "final_hf") if cfg.export_hf else None,
        tracking=dataclasses.replace(cfg.tracking, tracking_dir=cfg.tracking.tracking_dir or str(cfg.out)),
    )


def rollout_config(cfg: RunConfig, stores: list[str], home_nodes: list[str] | None = None) -> RolloutConfig:
    """The rollout's config: weight sync on, the lookahead limit set, G and the seed from the run, its groups placed
    on ``home_nodes`` (the stores on its host) as ``cfg.placement`` says."""
    return RolloutConfig(
        model=str(cfg.model_path), stores=stores, placement=cfg.placement, home_nodes=home_nodes or [],
        group_size=cfg.admission.group_size, max_tokens=cfg.max_tokens,
        seed=cfg.seed, prompts_per_wave=cfg.admission.train_batch_groups, max_groups=cfg.total_groups,
        max_unreleased_groups=cfg.lookahead_groups, lookahead_counts_running=True, lookahead_poll_s=0.1,
        weight_sync=True, wait_initial_weights_s=cfg.idle_timeout_s, version_poll_s=0.1, reward=cfg.reward,
        max_model_len=512, group_id_prefix=f"{cfg.policy}-", report_path=str(cfg.out / run_folder.ROLLOUT_REPORT),
        commit_ahead=cfg.admission.train_batch_groups, mix_chunk=cfg.admission.train_batch_groups,
        data_sources=dict(cfg.data_sources), partial_rollouts=cfg.partial_rollouts,
        events_path=str(cfg.out / ledger.EVENTS / ledger.ROLLOUT_EVENTS),
        synchronous=((cfg.admission.train_batch_groups, cfg.admission.mini_batches) if cfg.policy == "colocated"
                     else None),
    )


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
