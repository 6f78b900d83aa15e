"""What each ``knit run`` is, and what each of its processes is given: :class:`RunConfig` (one policy's run, the
source of ``knit run``'s flags) and the configs of the children it starts (:func:`store_configs`,
:func:`train_config`, :func:`rollout_config`), each written as a validated document (``schemas.documents``).

"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from admission.config import AdmissionConfig, LinkModel, Policy, Quota
from connectors.config import DEFAULT_DATA_SOURCES, EngineKind, GroupPlacement, RolloutConfig
from flight_store.config import ClusterMember, ServerConfig, StoreConfig
from flight_store.net import free_ports
from launcher import ledger, resume
from launcher.children import ROOT
from launcher.model import MODELS_DIR, RUN_MODELS, RunModelName
from launcher.placement import Placement
from schemas import run_folder
from train.config import ModelConfig, ObjectiveConfig, OptimConfig, ParallelConfig, TrainConfig
from train.tracking import TrackingConfig

COMPARED: tuple[Policy, ...] = ("train_batch", "mini_batch", "streaming")
"""The policies ``--compare`` runs, baseline first, the quota-free reference last."""
RUN_POLICIES: tuple[Policy, ...] = (*COMPARED, "colocated")
"""The policies ``knit run`` runs (``colocated``: the rollout generates each train batch with the weights the
trainer starts it from, and waits for them: synchronous, on-policy RL)."""


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
    engine: EngineKind = "vllm"
    """The rollout's engine: "vllm" in the rollout's process, or "vllm-server": a vLLM server driven over HTTP, the
    run's own (started beside the rollout, weights pulled through vLLM's weight-transfer API) unless ``engine_url``
    names one the user runs (``connectors.served``)."""
    engine_url: str | None = None
    """A vLLM server the user runs, for ``engine="vllm-server"`` (``http://HOST:PORT``)."""
    image_dedup: bool = True
    """Store each group's images once, every row referencing them (``--no-image-dedup``: a copy per row, stored,
    read and encoded per row: the baseline; ``RolloutConfig.image_dedup``)."""
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
        if self.engine_url is not None and self.engine != "vllm-server":
            msg = f"RunConfig.engine_url={self.engine_url!r} is for engine='vllm-server', not {self.engine!r}"
            raise ValueError(msg)
        if self.engine == "vllm-server" and self.partial_rollouts:
            msg = "RunConfig: partial_rollouts runs on the in-process engine only (engine='vllm')"
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
        data_sources=dict(cfg.data_sources), partial_rollouts=cfg.partial_rollouts, image_dedup=cfg.image_dedup,
        engine=cfg.engine, engine_url=cfg.engine_url, events_path=str(cfg.out / ledger.EVENTS / ledger.ROLLOUT_EVENTS),
        synchronous=((cfg.admission.train_batch_groups, cfg.admission.mini_batches) if cfg.policy == "colocated"
                     else None),
    )
