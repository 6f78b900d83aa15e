"""``knit run`` on the command line: flags from :class:`~launcher.run_config.RunConfig`, one or two policies, a summary.

Reads top to bottom as the job: parse -> prepare the model both sides share -> run each policy
(``launcher.run.run_policy``, with a live display) -> write ``summary.json`` and print the table.
Ctrl-C (or SIGTERM) stops every child and keeps the partial results (exit 130).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, cast

from admission.config import Policy
from launcher import progress, report, resume
from launcher.flags import add_flags, build
from launcher.lifeline import LeftoverProcessesError, RunFolderInUseError
from launcher.model import RUN_MODELS, prepare_model
from launcher.ray_deploy import RayNodeLostError, run_on_ray
from launcher.run import Interrupted, run_policy
from launcher.run_config import COMPARED, RUN_POLICIES, RunConfig
from schemas import run_folder
from schemas.run_summary import LookaheadTry, PolicySummary
from train.tracking import check_installed

MATCH = 0.95
"""``--match-throughput``: the share of train_batch's throughput (trajectories/s, the summary's) another policy's
lookahead must reach."""


QUICK_TRAIN_BATCHES = 3
"""Train batches of ``knit run --quick`` (under 2 minutes on 2 cores after the first start)."""


def parse(argv: Sequence[str]) -> tuple[list[RunConfig], argparse.Namespace]:
    """The config of each policy to run (three with ``--compare``), and the launcher-only flags."""
    parser = argparse.ArgumentParser(prog="knit run", description="Run the disaggregated RL loop on this machine: "
                                     "store nodes, a vLLM rollout worker and a Megatron trainer, with weight sync.")
    parser.add_argument("--compare", action="store_true",
                        help="run train_batch, mini_batch and streaming (quota-free), on the same seeds")
    parser.add_argument("--match-throughput", action=argparse.BooleanOptionalAction, default=None,
                        help="with --compare (the default there) or --policies: run train_batch first, then each "
                        "other policy (colocated, which waits for each train batch's weights, excepted) at its "
                        "smallest lookahead (one mini-batch of groups, two, ... up to 2B) whose throughput "
                        f"(trajectories/s) is at least {MATCH * 100:.0f}%% of train_batch's; every "
                        "try is reported. --no-match-throughput: each policy at its default lookahead")
    parser.add_argument("--policies", type=_policies, default=None, metavar="A,B,...",
                        help=f"run these policies one after another, on the same seeds (of {', '.join(RUN_POLICIES)}; "
                        "e.g. train_batch,mini_batch,colocated for a learning comparison)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_TRAIN_BATCHES} train batches unless --train-batches says otherwise")
    parser.add_argument("--plain", action="store_true", help="plain progress lines instead of the live display")
    parser.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                        help="deploy on the Ray cluster at ADDRESS (its GCS, host:port; none: the cluster this machine "
                        "is in): one store node per Ray node, the rollout and the trainer ranks as actors pinned to "
                        "nodes (launcher.ray_deploy)")
    parser.add_argument("--engine", choices=("vllm", "vllm-server", "fake"), default="vllm",
                        help="the rollout's engine: vllm in the rollout's process; vllm-server, a vLLM server driven "
                        "over HTTP, the run's own unless --engine-url names one (connectors.served); fake, with "
                        "--ray only: connectors.fake_engine, no model (default: vllm)")
    parser.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                        help="take up the run stopped in RUN_DIR (Ctrl-C or killed) from its last checkpoint, its "
                        "stores' spill logs and its event logs, with the config it was started with "
                        "(launcher.resume); no other flag is taken but --ray and --engine (a run started with "
                        "--ray is taken up with --ray)")
    flags = add_flags(parser, RunConfig, skip=("engine",))
    args = parser.parse_args(list(argv))
    if args.resume is not None:
        if args.compare or args.policies:
            parser.error("--resume takes up one run: no --compare or --policies")
        try:
            return [run_folder.read_run_config(RunConfig, args.resume.resolve() / run_folder.RUN_CONFIG)], args
        except (OSError, ValueError) as exc:  # RunFolderError names the file and the field
            parser.error(f"--resume {args.resume}: {exc}")
    if args.engine == "fake" and args.ray is None:
        parser.error("--engine fake runs with --ray only")
    if args.engine == "vllm-server" and args.ray is not None:
        parser.error("--engine vllm-server runs without --ray (the Ray deployment drives vLLM in process)")
    model = RUN_MODELS.get(getattr(args, "cfg__model", "tiny"))  # its defaults, under the flags given
    base = dict(model.run_defaults if model else {}) | ({"train_batches": QUICK_TRAIN_BATCHES} if args.quick else {})
    base["engine"] = "vllm-server" if args.engine == "vllm-server" else "vllm"
    try:
        cfg = build(RunConfig, flags, args, base=base)
    except ValueError as exc:
        parser.error(str(exc))
    cfg.out, cfg.model_dir = cfg.out.resolve(), cfg.model_path.resolve()
    if cfg.model == "tiny-vl":
        unsupported = [name for name, on in (("--engine vllm-server", args.engine == "vllm-server"),
                                             ("--ray", args.ray is not None), ("--export-hf", cfg.export_hf),
                                             ("--objective decoupled_ppo", cfg.loss.objective == "decoupled_ppo"))
                       if on]
        if unsupported:
            parser.error(f"--model tiny-vl does not run with {', '.join(unsupported)} yet")
    try:
        check_installed(cfg.tracking)  # before a run that would only warn about it
    except ImportError as exc:
        parser.error(str(exc))
    if args.compare and args.policies:
        parser.error("--compare and --policies: give one of them")
    policies = COMPARED if args.compare else args.policies
    if args.match_throughput is None:
        args.match_throughput = bool(args.compare)
    if args.match_throughput and (not policies or policies[0] != "train_batch"):
        parser.error("--match-throughput needs --compare, or --policies starting with train_batch (the baseline)")
    if not policies:
        return [cfg], args
    return [cfg.for_policy(p, cfg.out / p) for p in policies], args


def _policies(text: str) -> tuple[Policy, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in names if p not in RUN_POLICIES]
    if bad or not names or len(set(names)) != len(names):
        msg = f"--policies {text!r}: give distinct names among {', '.join(RUN_POLICIES)}"
        raise argparse.ArgumentTypeError(msg)
    return cast(tuple[Policy, ...], names)


def lookaheads(cfg: RunConfig) -> list[int]:
    """The lookaheads ``--match-throughput`` tries, smallest first: one mini-batch of groups, two, ... up to 2B."""
    step, top = cfg.admission.groups_per_mini_batch, 2 * cfg.admission.train_batch_groups
    return list(range(step, top + 1, step))


def _matched(cfg: RunConfig, baseline: PolicySummary, run_one: Callable[[RunConfig], PolicySummary],
             display: progress.Display) -> PolicySummary:
    """``cfg``'s policy at its smallest lookahead (:func:`lookaheads`) whose throughput (trajectories/s) is at least
    :data:`MATCH` of ``baseline``'s (each try a whole run, in ``<out>/lookahead<L>``); with none, the try of the
    highest throughput. The result lists every try under ``lookahead_search`` (with its throughput and the share of
    the training window its trainer was busy)."""
    target = MATCH * throughput(baseline)
    tries: list[LookaheadTry] = []
    best: PolicySummary | None = None
    rate = 0.0
    for lookahead in lookaheads(cfg):
        result = run_one(dataclasses.replace(cfg, lookahead=lookahead, out=cfg.out / f"lookahead{lookahead}"))
        rate = throughput(result)
        tries.append(LookaheadTry(lookahead=lookahead, trainer_busy=round(trainer_busy(result), 4),
                                  trajectories_per_s=rate, arch_staleness_mean=result.arch_staleness_mean,
                                  quota_violations=result.quota_violations))
        if best is None or rate > throughput(best):
            best = result  # a try that keeps up is the fastest so far: every earlier one was under the target
        if rate >= target:
            break
        display.note(f"[{cfg.policy}] lookahead {lookahead}: {rate:.3g} trajectories/s, under {target:.3g} "
                     f"({MATCH:.0%} of train_batch's)")
    assert best is not None  # lookaheads() is never empty: B/K <= 2B
    return best.model_copy(update={"lookahead_search": tries, "matched_throughput": rate >= target})


def throughput(result: PolicySummary) -> float:
    """A run's throughput as its summary reports it: trajectories trained per second. What ``--match-throughput``
    matches."""
    return result.throughput.trajectories_per_s


def trainer_busy(result: PolicySummary) -> float:
    """The share of a run's training window the trainer was not waiting for admission (1 - idle / window), reported
    beside each try's throughput."""
    window = result.training_window_s
    return max(0.0, 1.0 - result.trainer_idle_s / window) if window > 0 else 0.0


def _run_on_ray(cfg: RunConfig, model: Any, args: argparse.Namespace, stop: threading.Event,
                update: Any) -> PolicySummary:
    return run_on_ray(cfg, model, address=args.ray, engine=args.engine, stop=stop, on_update=update,
                      resumed=resume.begin(cfg.out) if args.resume else None)


def main(argv: Sequence[str] | None = None) -> int:
    """``knit run``; returns 0 on success, 130 when interrupted, 2 when its run folder is in use or holds processes it
    cannot stop (``launcher.lifeline``), 3 when ``--ray`` lost a node
    (``launcher.ray_deploy.RayNodeLostError``)."""
    configs, args = parse(list(argv) if argv is not None else [])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = configs[0].out.parent if len(configs) > 1 else configs[0].out
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    display = progress.Display(plain=args.plain)
    results: dict[str, PolicySummary] = {}
    try:
        first = configs[0]
        adm = first.admission
        display.note(f"knit run: {', '.join(c.policy for c in configs)}; B={adm.train_batch_groups} "
                     f"G={adm.group_size} K={adm.mini_batches} D={adm.dp_ranks}, {first.train_batches} train batches; "
                     f"run folder {out}")
        model = prepare_model(first.model_path, seed=first.seed, model=first.model)

        def run_one(cfg: RunConfig) -> PolicySummary:
            if stop.is_set():
                raise Interrupted
            display.note(f"[{cfg.policy}] lookahead {cfg.lookahead_groups} groups; logs in {cfg.out / 'logs'}")
            with display.live(cfg.policy, cfg.total_groups, cfg.steps) as update:
                result = (run_policy(cfg, model, stop=stop, on_update=update,
                                     resumed=resume.begin(cfg.out) if args.resume else None) if args.ray is None
                          else _run_on_ray(cfg, model, args, stop, update))
            if result.ledger is not None:
                display.note(f"[{cfg.policy}] {result.ledger.summary}")
            for o in result.store_outages:
                if o.lost_at is not None:
                    display.note(f"[{cfg.policy}] store {o.node} ({o.store}) was lost for good; its groups not "
                                 "trained were generated again")
                    continue
                if o.cause == "unreachable":
                    display.note(f"[{cfg.policy}] store {o.node} ({o.store}) did not answer for {o.down_s} s "
                                 "while its process ran (its host was cut off)")
                    continue
                display.note(f"[{cfg.policy}] store {o.node} ({o.store}) exited with {o.exit_code}; "
                             f"started again {o.restarts} time(s), back after {o.down_s} s")
            urls = result.metrics_urls
            if urls:
                display.note(f"[{cfg.policy}] Prometheus metrics were served at {', '.join(urls)}")
            files = [name for name in cfg.tracking.logger if name != "console"]
            if files:  # where each step's figures went (train.step_tracking)
                display.note(f"[{cfg.policy}] {', '.join(files)}: each step's figures in "
                             f"{cfg.tracking.tracking_dir or cfg.out}")
            return result

        for cfg in configs:
            baseline = results.get("train_batch")
            if args.match_throughput and baseline is not None and cfg.lookahead is None and cfg.policy != "colocated":
                results[cfg.policy] = _matched(cfg, baseline, run_one, display)
            else:
                results[cfg.policy] = run_one(cfg)
    except Interrupted:
        display.note("interrupted: every process stopped; partial results are in the run folder")
        return 130
    except RayNodeLostError as exc:
        display.note(f"knit run --ray: {exc}; what the other nodes held is in {out} (lost_node.json); take it up "
                     f"with knit run --resume {out} --ray")
        return 3
    except (RunFolderInUseError, LeftoverProcessesError) as exc:
        display.note(f"knit run: {exc}")
        return 2
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    summary = report.write_summary(Path(out), results)
    display.summary(summary)
    print(f"run folder: {out}")
    return 0
