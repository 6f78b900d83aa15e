"""``knit run``: the main job, a real disaggregated RL loop on one machine.

What it starts, each as a subprocess in its own process group (so Ctrl-C reaches only this driver,
which then stops every child it started, by process group id):

1. two store nodes (``python -m flight_store serve``; with Prometheus ``/metrics`` where the store
   CLI offers ``--metrics-port``);
2. a Megatron-core trainer (``python -m train --nproc 2``; gloo on CPU), whose rank 0 plans with
   ``admission.Planner`` (``mini_batch`` by default, ``train_batch`` as the baseline), publishes
   its starting weights as version 0 and the weights of every new version, and releases consumed
   groups;
3. a vLLM rollout worker (``python -m connectors.rollout``) on a tiny Llama of exactly the
   trainer's shape, which loads the trainer's version-0 weights before it generates, loads every
   newly published version into the running engine, and streams each finished prompt group to
   the stores. The lookahead limit (groups dispatched but not yet consumed) couples the two.

This driver never imports vLLM or torch and never reads trajectory payload: it polls the stores'
``stats``, follows the trainer's per-step progress file, and at the end writes the run folder
(``train.report``): ``summary.json``, ``metadata.parquet``, ``consumed.parquet``, plots.

Lookahead defaults (a fair comparison at matched throughput, DESIGN.md): ``train_batch`` needs the
rollout a whole train batch ahead, so its limit is 2B groups; ``mini_batch`` keeps the trainer busy
with B + B/K. Both count the groups running in the engine, so the limit bounds everything
dispatched and not yet consumed.

Example:
    knit run --quick --compare --out runs/compare
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

from train.config import ModelConfig
from train.weights import hf_llama_config

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("mini_batch", "train_batch")
MODEL_PRESET = "tiny-vllm"
DEFAULT_TRAIN_BATCHES = 300
"""`knit run` without --quick: 600 optimizer steps, ~2.5 minutes on a quiet 2-core machine (5+ when shared)."""
CHILD_ENV = {
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "PYTHONWARNINGS": "ignore",
}
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings",
              "tie_word_embeddings")


class Interrupted(Exception):
    """Ctrl-C or SIGTERM reached the driver."""


# ---- reward of the built-in loop --------------------------------------------------------------


def digit_reward(prompt: str, response: str, sample: dict[str, Any]) -> float:
    """Share of the response's non-space characters that are digits (partial credit, in [0, 1]).

    The built-in arithmetic tasks are out of reach of a tiny random model (exact match is ~always 0,
    so every GRPO advantage would be 0 and the weights would never change); this shaped reward
    varies within a group, so the loop really learns: the reward per train batch rises.
    """
    del prompt, sample
    chars = [c for c in response if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


REWARDS = {"digits": "train.run:digit_reward", "exact": "connectors.tasks:exact_match_reward"}


# ---- configuration ----------------------------------------------------------------------------


def default_lookahead(policy: str, groups: int, mini_batches: int) -> int:
    """Groups the rollout may run ahead of training: 2B for ``train_batch``, B + B/K for ``mini_batch``."""
    if policy == "train_batch":
        return 2 * groups
    if policy == "mini_batch":
        return groups + groups // mini_batches
    msg = f"no default lookahead for policy {policy!r}; known: {POLICIES}"
    raise ValueError(msg)


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """One ``knit run`` (one policy; ``--compare`` builds two).

    Example:
        >>> cfg = RunConfig(policy="mini_batch", train_batches=3, out=Path("runs/x"))
        >>> cfg.lookahead_groups, cfg.steps, cfg.total_groups
        (12, 6, 24)
    """

    policy: str = "mini_batch"
    """Admission policy of the trainer's planner: ``mini_batch`` or ``train_batch``."""
    train_batches: int = DEFAULT_TRAIN_BATCHES
    """Train batches to run (the trainer takes ``train_batches * mini_batches`` optimizer steps)."""
    groups: int = 8
    """B: prompt groups per train batch."""
    group_size: int = 4
    """G: responses per prompt."""
    mini_batches: int = 2
    """K: optimizer steps per train batch."""
    dp: int = 2
    """Trainer ranks (data parallel)."""
    max_tokens: int = 64
    """Longest response, tokens."""
    lookahead: int | None = None
    """Groups dispatched but not yet consumed (None = the policy's default, see :func:`default_lookahead`)."""
    seed: int = 0
    """Seed of the prompt stream, sampling and the tiny model (same seed = same prompts for both policies)."""
    lr: float = 3e-3
    """Trainer learning rate."""
    reward: str = "digits"
    """Reward: ``digits`` (shaped, learnable by the tiny model), ``exact`` (arithmetic exact match), or module:fn."""
    nodes: int = 2
    """Store nodes."""
    idle_timeout_s: float = 180.0
    """The trainer stops when no mini-batch becomes admissible for this long (covers vLLM start-up)."""
    timeout_s: float = 900.0
    """The whole run is stopped after this long."""
    model_dir: Path = field(default_factory=lambda: ROOT / "runs" / ".models" / "tiny-llama")
    """Where the tiny Llama (tokenizer + weights of the trainer's shape) is built once and reused."""
    out: Path = field(default_factory=lambda: ROOT / "runs" / time.strftime("%Y%m%d-%H%M%S"))
    """This policy's run folder."""
    metrics: bool = True
    """Serve Prometheus metrics from each store when its CLI supports ``--metrics-port``."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            msg = f"RunConfig.policy={self.policy!r} must be one of {POLICIES}"
            raise ValueError(msg)
        for name in ("train_batches", "groups", "group_size", "mini_batches", "dp", "max_tokens", "nodes"):
            if getattr(self, name) < 1:
                msg = f"RunConfig.{name}={getattr(self, name)} must be >= 1"
                raise ValueError(msg)
        if self.groups % self.mini_batches or self.groups // self.mini_batches < self.dp:
            msg = (f"RunConfig: groups={self.groups} must split into mini_batches={self.mini_batches} of at least "
                   f"dp={self.dp} groups each")
            raise ValueError(msg)
        if self.lookahead is not None and self.lookahead < self.groups // self.mini_batches:
            msg = f"RunConfig.lookahead={self.lookahead} is below one mini-batch ({self.groups // self.mini_batches})"
            raise ValueError(msg)

    @property
    def lookahead_groups(self) -> int:
        """The lookahead limit in effect."""
        return self.lookahead if self.lookahead is not None else default_lookahead(self.policy, self.groups,
                                                                                     self.mini_batches)

    @property
    def steps(self) -> int:
        """Optimizer steps the trainer takes."""
        return self.train_batches * self.mini_batches

    @property
    def total_groups(self) -> int:
        """Prompt groups the rollout generates (exactly what the trainer consumes)."""
        return self.train_batches * self.groups


# ---- the model both sides share ---------------------------------------------------------------


def trainer_model(vocab_size: int) -> ModelConfig:
    """The trainer's model: the ``tiny-vllm`` preset (head_dim 32) with the tokenizer's vocabulary."""
    cfg = ModelConfig.preset(MODEL_PRESET)
    cfg.vocab_size = vocab_size
    return cfg


def check_shapes(hf_config: dict[str, Any], model: ModelConfig) -> None:
    """Raise ValueError naming every field where the HF Llama config (what vLLM runs) differs from ``model``."""
    want = hf_llama_config(model)
    bad = [f"{k}: vLLM {hf_config.get(k)!r} vs trainer {want[k]!r}" for k in SHAPE_KEYS
           if hf_config.get(k, 10000.0 if k == "rope_theta" else None) != want[k]]
    if hf_config.get("architectures") != ["LlamaForCausalLM"]:
        bad.append(f"architectures: {hf_config.get('architectures')!r}")
    if bad:
        msg = "the rollout model and the trainer model differ: " + "; ".join(bad)
        raise ValueError(msg)


def prepare_model(model_dir: Path, *, seed: int = 0) -> ModelConfig:
    """Build the tiny Llama of the trainer's shape at ``model_dir`` (once); returns the trainer's config."""
    tiny = ModelConfig.preset(MODEL_PRESET)
    if not (model_dir / "config.json").exists():
        kwargs = {"layers": tiny.num_layers, "hidden": tiny.hidden_size, "heads": tiny.num_attention_heads,
                  "kv_heads": tiny.num_query_groups, "intermediate": tiny.ffn_hidden_size, "vocab": 512,
                  "max_positions": tiny.max_sequence_length, "seed": seed}
        code = (f"from connectors.tiny_model import build_tiny_llama; "
                f"build_tiny_llama({str(model_dir)!r}, **{kwargs!r})")
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), check=True, timeout=300,
                       capture_output=True)
    hf = json.loads((model_dir / "config.json").read_text())
    model = trainer_model(int(hf["vocab_size"]))
    check_shapes(hf, model)
    return model


# ---- child processes --------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    """Environment of every child: one thread each, offline, the project on the path."""
    env = dict(os.environ, **CHILD_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    return env


def free_port() -> int:
    """A free loopback port (bound and released; the child binds it right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class Child:
    """A started subprocess (leader of its own process group) and its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None


class Children:
    """Starts subprocesses in their own process groups and stops every one of them, by group id.

    Example:
        >>> with Children(Path("/tmp/logs")) as kids:  # doctest: +SKIP
        ...     kids.start("store0", [sys.executable, "-m", "flight_store", "serve", "--port", "0"])
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[Child] = []

    def start(self, name: str, cmd: list[str]) -> Child:
        """Start ``cmd`` with its output in ``<log_dir>/<name>.log``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"{name}.log"
        fh = path.open("wb")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        child = Child(name=name, proc=proc, log_path=path, log_file=fh)
        self.started.append(child)
        doc = [{"name": c.name, "pid": c.pid, "cmd": c.proc.args} for c in self.started]
        (self.log_dir / "children.json").write_text(json.dumps(doc, indent=1, default=str))
        log.info("started %s (pid %d): %s", name, proc.pid, " ".join(cmd))
        return child

    @staticmethod
    def _signal(child: Child, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, sig)  # the group this driver created for the child (pgid == its pid)

    def stop(self, child: Child, *, grace_s: float = 15.0) -> int | None:
        """SIGTERM the child's process group, wait ``grace_s``, then SIGKILL what is left; returns the exit code."""
        if child.alive():
            self._signal(child, signal.SIGTERM)
            try:
                child.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) did not stop in %.0f s: killing its process group", child.name, child.pid,
                            grace_s)
        self._signal(child, signal.SIGKILL)  # stragglers of the group (e.g. spawned trainer ranks)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=10)
        child.log_file.close()
        return child.proc.returncode

    def stop_all(self) -> None:
        """Stop every child, the last started first."""
        for child in reversed(self.started):
            self.stop(child)

    def tail(self, child: Child, lines: int = 30) -> str:
        """The last lines of a child's log."""
        child.log_file.flush()
        text = child.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def store_supports_metrics() -> bool:
    """True when ``knit serve`` offers ``--metrics-port`` (Prometheus)."""
    from flight_store import cli

    return "--metrics-port" in cli._parser().format_help() or any(
        "--metrics-port" in a.format_help() for a in _subparsers(cli._parser()))


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out: list[argparse.ArgumentParser] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out.extend(action.choices.values())
    return out


@dataclass(slots=True)
class Stores:
    """The store nodes of one run."""

    locations: list[str]
    metrics_urls: list[str]
    children: list[Child]


def start_stores(kids: Children, n: int, *, metrics: bool, timeout_s: float = 60.0) -> Stores:
    """Start ``n`` store nodes on free ports and wait until each answers ``health``."""
    from flight_store.client import StoreClient

    with_metrics = metrics and store_supports_metrics()
    locations, urls, children = [], [], []
    for i in range(n):
        port = free_port()
        cmd = [sys.executable, "-m", "flight_store", "serve", "--port", str(port), "--node-name", f"node{i}",
               "--log-level", "WARNING"]
        if with_metrics:
            mport = free_port()
            cmd += ["--metrics-port", str(mport)]
            urls.append(f"http://127.0.0.1:{mport}/metrics")
        children.append(kids.start(f"store{i}", cmd))
        locations.append(f"grpc://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout_s
    with StoreClient(locations, timeout=2.0) as client:
        while True:
            health = client.health()
            if all(h.get("ok") for h in health.values()):
                break
            dead = [c for c in children if not c.alive()]
            if dead or time.monotonic() > deadline:
                who = dead[0] if dead else children[0]
                msg = f"store node {who.name} did not come up:\n{kids.tail(who)}"
                raise RuntimeError(msg)
            time.sleep(0.2)
    return Stores(locations=locations, metrics_urls=urls, children=children)


def trainer_cmd(cfg: RunConfig, model: ModelConfig, stores: Sequence[str]) -> list[str]:
    """``python -m train --nproc D ...`` for this run."""
    opts = {"train_batch_groups": cfg.groups, "group_size": cfg.group_size, "mini_batches": cfg.mini_batches,
            "policy": cfg.policy, "token_budget": 4096}
    cmd = [sys.executable, "-m", "train", "--stores", ",".join(stores), "--nproc", str(cfg.dp), "--model", MODEL_PRESET,
           "--vocab-size", str(model.vocab_size), "--backend", "gloo", "--lr", str(cfg.lr), "--publish-weights",
           "--max-steps", str(cfg.steps), "--idle-timeout", str(cfg.idle_timeout_s),
           "--report", str(cfg.out / "trainer_rank{rank}.json"), "--progress", str(cfg.out / "progress.jsonl"),
           "--consumed", str(cfg.out / "consumed.parquet"), "--seed", str(1234 + cfg.seed), "--log-level", "INFO"]
    for k, v in opts.items():
        cmd += ["--planner-option", f"{k}={v}"]
    return cmd


def rollout_cmd(cfg: RunConfig, stores: Sequence[str]) -> list[str]:
    """``python -m connectors.rollout ...`` for this run: weight sync on, lookahead limit set."""
    return [sys.executable, "-m", "connectors.rollout", "--model", str(cfg.model_dir), "--nodes", ",".join(stores),
            "--groups", str(cfg.total_groups), "--group-size", str(cfg.group_size),
            "--max-tokens", str(cfg.max_tokens), "--seed", str(cfg.seed), "--prompts-per-wave", str(cfg.groups),
            "--max-unreleased-groups", str(cfg.lookahead_groups), "--lookahead-counts-running",
            "--lookahead-poll-s", "0.1", "--weight-sync", "--wait-initial-weights", str(cfg.idle_timeout_s),
            "--version-poll-s", "0.1", "--reward-fn", REWARDS.get(cfg.reward, cfg.reward),
            "--max-model-len", "512", "--group-id-prefix", f"{cfg.policy}-",
            "--report-json", str(cfg.out / "rollout.json")]


# ---- one run ----------------------------------------------------------------------------------


@dataclass(slots=True)
class LiveState:
    """What the progress display shows, refreshed from the stores and the trainer's progress file."""

    policy: str = ""
    phase: str = "starting"
    total_groups: int = 0
    total_steps: int = 0
    written: int = 0
    admitted: int = 0
    consumed: int = 0
    version: int = 0
    steps: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @property
    def staleness_mean(self) -> float:
        rows = sum(s.get("rows", 0) for s in self.steps if "arch_staleness_mean" in s)
        if not rows:
            return 0.0
        return sum(s["arch_staleness_mean"] * s["rows"] for s in self.steps if "arch_staleness_mean" in s) / rows

    @property
    def staleness_max(self) -> int:
        return max((int(s.get("arch_staleness_max", 0)) for s in self.steps), default=0)


def _read_progress(path: Path, state: LiveState) -> None:
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    for line in lines[len(state.steps):]:
        try:
            state.steps.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written: read it next time
    if state.steps:
        state.admitted = max(state.admitted, int(state.steps[-1].get("admitted_groups") or 0))


def run_policy(cfg: RunConfig, model: ModelConfig, *, stop: threading.Event,
               on_update: Callable[[LiveState], None] | None = None) -> dict[str, Any]:
    """Run one policy end to end; returns the run's results (``train.report.policy_summary``)."""
    from flight_store.client import StoreClient
    from train import report

    cfg.out.mkdir(parents=True, exist_ok=True)
    for stale in ("progress.jsonl", "consumed.parquet", "rollout.json"):
        (cfg.out / stale).unlink(missing_ok=True)
    state = LiveState(policy=cfg.policy, total_groups=cfg.total_groups, total_steps=cfg.steps)
    t0 = time.time()
    interrupted = False
    with Children(cfg.out / "logs") as kids:
        stores = start_stores(kids, cfg.nodes, metrics=cfg.metrics)
        state.phase = "starting trainer + vLLM"
        trainer = kids.start("trainer", trainer_cmd(cfg, model, stores.locations))
        rollout = kids.start("rollout", rollout_cmd(cfg, stores.locations))
        deadline = time.monotonic() + cfg.timeout_s
        with StoreClient(stores.locations, timeout=5.0) as client:
            try:
                while trainer.alive():
                    if stop.is_set():
                        raise Interrupted
                    if time.monotonic() > deadline:
                        msg = f"run {cfg.policy} exceeded {cfg.timeout_s} s"
                        raise TimeoutError(msg)
                    _poll(client, cfg, state)
                    if not rollout.alive() and rollout.proc.returncode not in (0, None):
                        msg = f"the rollout worker failed (exit {rollout.proc.returncode}):\n{kids.tail(rollout)}"
                        raise RuntimeError(msg)
                    if on_update:
                        on_update(state)
                    stop.wait(0.5)
                if trainer.proc.returncode != 0:
                    msg = f"the trainer failed (exit {trainer.proc.returncode}):\n{kids.tail(trainer, 40)}"
                    raise RuntimeError(msg)
                state.phase = "finishing"
                _poll(client, cfg, state)
                if on_update:
                    on_update(state)
                kids.stop(rollout, grace_s=30.0)  # all groups were consumed: it has finished or stops now
            except Interrupted:
                interrupted = True
                state.phase = "interrupted"
                kids.stop(trainer, grace_s=5.0)
                kids.stop(rollout, grace_s=15.0)  # aborts the groups still running and writes them
            # the stores are still up: export the metadata of every node, then stop them (Children.__exit__)
            metadata = client.metadata().collect()
            stats = client.stats()
        metadata.write_parquet(cfg.out / "metadata.parquet")
        (cfg.out / "store_stats.json").write_text(json.dumps(stats, indent=1))
    wall = time.time() - t0
    result = report.policy_summary(cfg.out, config=asdict(cfg) | {"lookahead_groups": cfg.lookahead_groups},
                                   wall_s=wall, metrics_urls=stores.metrics_urls)
    result["interrupted"] = interrupted
    (cfg.out / "policy_summary.json").write_text(json.dumps(result, indent=1, default=str))
    report.plot_policy(cfg.out, result)
    if interrupted:
        raise Interrupted
    return result


def _poll(client: Any, cfg: RunConfig, state: LiveState) -> None:
    try:
        stats = client.stats()
    except Exception as exc:  # a slow answer is not fatal for a progress display
        log.debug("stats failed: %s", exc)
        return
    state.written = sum(int(s["groups"]["stored"]) + int(s["groups"]["released"]) for s in stats.values())
    state.consumed = sum(int(s["groups"]["released"]) for s in stats.values())
    state.version = max(int(s.get("policy_version", 0)) for s in stats.values())
    _read_progress(cfg.out / "progress.jsonl", state)
    if state.steps:
        state.phase = "training"


# ---- CLI --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="knit run", description="Run the disaggregated RL loop on this machine: 2 store "
                                "nodes, a vLLM rollout worker and a 2-rank Megatron trainer, with weight sync.")
    p.add_argument("--policy", choices=POLICIES, default="mini_batch", help="admission policy (default mini_batch)")
    p.add_argument("--compare", action="store_true", help="run train_batch then mini_batch on the same seeds")
    p.add_argument("--quick", action="store_true", help="3 train batches (under 2 minutes on 2 cores)")
    p.add_argument("--train-batches", type=int, default=None,
                   help=f"train batches per policy (default {DEFAULT_TRAIN_BATCHES}; quick 3)")
    p.add_argument("--groups", type=int, default=8, help="B, prompt groups per train batch")
    p.add_argument("--group-size", type=int, default=4, help="G, responses per prompt")
    p.add_argument("--mini-batches", type=int, default=2, help="K, optimizer steps per train batch")
    p.add_argument("--max-tokens", type=int, default=64, help="longest response")
    p.add_argument("--lookahead", type=int, default=None,
                   help="groups dispatched but not consumed (default: 2B for train_batch, B+B/K for mini_batch)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--reward", default="digits", help="digits | exact | module:function")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="run folder (default runs/<timestamp>)")
    p.add_argument("--model-dir", type=Path, default=None, help="tiny Llama folder (built once)")
    p.add_argument("--no-metrics", action="store_true", help="do not serve Prometheus metrics from the stores")
    p.add_argument("--plain", action="store_true", help="plain progress lines instead of the live display")
    p.add_argument("--timeout", type=float, default=900.0, help="stop a policy's run after this many seconds")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``knit run``; returns 0 on success, 130 when interrupted."""
    from train import progress, report

    args = build_parser().parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = (args.out or ROOT / "runs" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    batches = args.train_batches or (3 if args.quick else DEFAULT_TRAIN_BATCHES)
    policies = ["train_batch", "mini_batch"] if args.compare else [args.policy]
    base: dict[str, Any] = {"train_batches": batches, "groups": args.groups, "group_size": args.group_size,
                            "mini_batches": args.mini_batches, "max_tokens": args.max_tokens, "lr": args.lr,
                            "reward": args.reward, "seed": args.seed, "metrics": not args.no_metrics,
                            "timeout_s": args.timeout}
    if args.model_dir is not None:
        base["model_dir"] = args.model_dir.resolve()
    configs = [RunConfig(policy=p, out=out / p if args.compare else out,
                         lookahead=args.lookahead, **base) for p in policies]

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    display = progress.Display(plain=args.plain)
    results: dict[str, dict[str, Any]] = {}
    try:
        display.note(f"knit run: {', '.join(policies)}; B={args.groups} G={args.group_size} K={args.mini_batches} "
                     f"D=2, {batches} train batches; run folder {out}")
        model = prepare_model(configs[0].model_dir, seed=args.seed)
        for cfg in configs:
            if stop.is_set():
                raise Interrupted
            display.note(f"[{cfg.policy}] lookahead {cfg.lookahead_groups} groups; logs in {cfg.out / 'logs'}")
            with display.live(cfg.policy, cfg.total_groups, cfg.steps) as update:
                results[cfg.policy] = run_policy(cfg, model, stop=stop, on_update=update)
            urls = results[cfg.policy].get("metrics_urls") or []
            if urls:
                display.note(f"[{cfg.policy}] Prometheus metrics were served at {', '.join(urls)}")
    except Interrupted:
        display.note("interrupted: every process stopped; partial results are in the run folder")
        return 130
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    summary = report.write_summary(out, results)
    display.summary(summary)
    print(f"run folder: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
