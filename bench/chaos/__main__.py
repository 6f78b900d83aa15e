"""``python -m bench.chaos [--quick] [--seeds N] [--seed S] --out F.json``: the main job under faults that come
together, and whether it loses or duplicates anything.

Five hosts as network namespaces on this machine: three store hosts, the rollout's, the trainer's (two ranks). The
launcher (``bench.chaos.driver``: ``knit run``'s ``run_policy`` with that placement, the tiny model) runs in a
process of its own. For 10 minutes (2 with ``--quick``), every 8-20 s (6-12) a fault drawn from the seed is
injected (``bench.chaos.faults``): a store node SIGKILLed, a store host's link cut for 5-60 s (5-30), a store host
lost for good (one at most), the rollout SIGKILLed, 100-300 idle DoPuts, malformed DoPuts, a reader that stops
mid-stream, the launcher SIGKILLed and started again with ``--resume``. Then the run goes on to its end.

Afterwards the invariants (``invariants_broken`` lists each one broken with its seed; empty when all hold):

* ``run_completed``: the launcher's last life exits 0 with every train batch trained;
* ``no_prompt_trained_twice`` and ``no_prompt_lost``: the prompt ledger (``launcher.ledger``: every prompt drawn,
  every attempt) has each prompt trained exactly once by the weights that survive, or dropped with a named reason;
* ``every_stored_group_explained``: every group a store acknowledged (the stores' metadata at the end) is in the
  ledger, trained or dropped with a reason;
* ``malformed_refused``: no malformed DoPut was taken;
* ``no_orphans``: no process of the run is left, in the hosts or naming the run folder.

``metrics``: ``faults_<kind>``, ``recoveries`` (faults followed by a step), ``fault_to_next_step_s_{p50,max}``,
``lost_prompts``, ``trained_twice``, ``unexplained_groups``, ``orphans``, per seed and summed; and
``malformed_puts_unreached``, the malformed puts that found their node down (they tested nothing).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench._common import write_result
from bench.chaos.driver import write_spec
from bench.chaos.faults import INJECT, KINDS, Fault, Target

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Window:
    """How long faults come, how far apart, and the run's length (it must outlast the window)."""

    window_s: float
    gap_s: tuple[float, float]
    train_batches: int


QUICK = Window(window_s=120.0, gap_s=(6.0, 12.0), train_batches=40)
FULL = Window(window_s=600.0, gap_s=(8.0, 20.0), train_batches=200)


class Launcher:
    """The driver process of one run, started again with ``--resume`` after a kill."""

    def __init__(self, spec: Path, log: Path) -> None:
        self.spec, self.log = spec, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.lives = 0

    def start(self, *, resume: bool = False) -> None:
        from launcher.children import child_env

        if self.proc is not None:
            self.proc.wait(timeout=120)  # a killed launcher is reaped before its run is taken up
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "bench.chaos.driver", str(self.spec),
                                          *(["--resume"] if resume else [])], cwd=ROOT, env=child_env(),
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.lives += 1

    def pid(self) -> int:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else 0


def _steps(out: Path) -> list[float]:
    """``t_end`` of every step in ``progress.jsonl`` so far."""
    try:
        lines = (out / "progress.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [float(json.loads(line)["t_end"]) for line in lines if line.strip()]


def _orphans(out: Path, hosts: Any) -> list[int]:
    """Live processes inside the hosts, or naming the run folder on their command line (never this one)."""
    from launcher.lifeline import processes_naming

    return sorted({p for h in hosts for p in h.pids()} | set(processes_naming(str(out))))


def run_seed(seed: int, quick: bool, work: Path) -> dict[str, Any]:
    """One chaos run: its faults, its recoveries and its invariants."""
    import polars as pl

    from admission.config import AdmissionConfig
    from launcher import ledger
    from launcher.hosts import Hosts
    from launcher.model import prepare_model
    from launcher.placement import Placement
    from launcher.run_config import RunConfig
    from schemas import run_folder

    p = QUICK if quick else FULL
    out = (work / f"seed{seed}").resolve()
    cfg = RunConfig(admission=AdmissionConfig(train_batch_groups=4, group_size=4, mini_batches=2, dp_ranks=2,
                                              token_budget=4096),
                    train_batches=p.train_batches, max_tokens=24, num_stores=3, seed=seed, out=out,
                    timeout_s=3 * p.window_s + 600, metrics=False, store_start_timeout_s=45.0,
                    max_store_restarts=20, max_rollout_restarts=20)
    cfg.model_dir = cfg.model_path.resolve()
    prepare_model(cfg.model_dir, seed=0)
    rng = random.Random(seed)
    faults: list[Fault] = []
    with Hosts(5) as hosts:
        h = hosts.hosts
        placement = Placement(stores=[x.site() for x in h[:3]], rollout=h[3].site(), trainer=[h[4].site()],
                              probe_s=1.0)
        out.mkdir(parents=True, exist_ok=True)
        run_folder.write_run_config(cfg, out / run_folder.RUN_CONFIG)
        write_spec(out.parent / f"seed{seed}.spec.json", out, placement)
        launcher = Launcher(out.parent / f"seed{seed}.spec.json", out.parent / f"seed{seed}.launcher.log")
        target = Target(out=out, store_hosts=h[:3], launcher_pid=launcher.pid,
                        restart_launcher=lambda: launcher.start(resume=True))
        launcher.start()
        t0 = time.time()
        while not _steps(out) and launcher.pid() and time.time() - t0 < 600:  # faults begin once training runs
            time.sleep(0.5)
        start = time.time()
        next_at = start + rng.uniform(*p.gap_s)
        deadline = start + p.window_s * 3 + 900
        try:
            while time.time() < deadline:
                now = time.time()
                target.restore_due(now)
                if launcher.proc is not None and launcher.proc.poll() is not None:
                    break  # the run ended (or failed)
                if now >= next_at and now < start + p.window_s:
                    kind = rng.choice(KINDS)
                    fault = INJECT[kind](target, rng, quick)
                    if fault is not None:
                        faults.append(fault)
                    next_at = now + rng.uniform(*p.gap_s)
                if now >= start + p.window_s:  # the window is over: every cut ends (a lost host stays out)
                    target.end_cuts()
                time.sleep(0.2)
        finally:
            target.restore_all()
            if launcher.proc is not None and launcher.proc.poll() is None:
                launcher.proc.terminate()
                launcher.proc.wait(timeout=180)
            for thread in target.holders:
                thread.join(timeout=30)
        rc = launcher.proc.returncode if launcher.proc is not None else None
        time.sleep(2.0)
        orphans = _orphans(out, h)
    steps = sorted(_steps(out))
    metadata = pl.read_parquet(out / run_folder.METADATA) if (out / run_folder.METADATA).exists() else None
    table = ledger.build(out, metadata)
    bad = ledger.exceptions(table)
    twice = bad.filter(pl.col("trained") > 1).height
    lost = bad.filter(pl.col("trained") == 0).height
    stored = set(metadata["group_id"].to_list()) if metadata is not None else set()
    known = set(table["group_id"].to_list())
    unexplained = sorted(g for g in stored - known if "chaos-" not in g)
    summary = out / "policy_summary.json"  # the last life's (``launcher.report.write_policy_summary``)
    done = int(json.loads(summary.read_text()).get("steps", 0)) if summary.exists() else 0
    waits = [next((s for s in steps if s > f.at), None) for f in faults]
    to_step = [w - f.at for w, f in zip(waits, faults, strict=True) if w is not None]
    broken = [name for name, ok in (
        ("run_completed", rc == 0 and done == cfg.steps), ("no_prompt_trained_twice", twice == 0),
        ("no_prompt_lost", lost == 0), ("every_stored_group_explained", not unexplained),
        ("malformed_refused", sum(f.accepted for f in faults) == 0), ("no_orphans", not orphans)) if not ok]
    return {"seed": seed, "faults": [asdict(f) for f in faults], "launcher_rc": rc, "launcher_lives": launcher.lives,
            "steps": done, "steps_wanted": cfg.steps, "recoveries": len(to_step), "fault_to_next_step_s": to_step,
            "lost_prompts": lost, "trained_twice": twice, "unexplained_groups": unexplained, "orphans": orphans,
            "ledger": ledger.summary_line(table), "invariants_broken": broken, "out": str(out)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 2-minute fault window (else 10 minutes)")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--seeds", type=int, default=1, help="runs back to back, seeds S, S+1, ...")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "chaos", help="where the run folders go")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    runs = [run_seed(s, args.quick, args.work) for s in range(args.seed, args.seed + args.seeds)]
    kinds = Counter(f["kind"] for r in runs for f in r["faults"])
    to_step = [s for r in runs for s in r["fault_to_next_step_s"]]
    metrics: dict[str, Any] = {f"faults_{k}": kinds.get(k, 0) for k in KINDS}
    metrics.update(
        faults=sum(kinds.values()), recoveries=sum(r["recoveries"] for r in runs),
        fault_to_next_step_s_p50=round(statistics.median(to_step), 2) if to_step else None,
        fault_to_next_step_s_max=round(max(to_step), 2) if to_step else None,
        lost_prompts=sum(r["lost_prompts"] for r in runs), trained_twice=sum(r["trained_twice"] for r in runs),
        unexplained_groups=sum(len(r["unexplained_groups"]) for r in runs),
        malformed_puts_unreached=sum(f["unreached"] for r in runs for f in r["faults"]),
        orphans=sum(len(r["orphans"]) for r in runs))
    broken = [{"invariant": name, "seed": r["seed"]} for r in runs for name in r["invariants_broken"]]
    write_result(args.out, metrics, {}, {"quick": args.quick, "seeds": [r["seed"] for r in runs],
                                         "window_s": (QUICK if args.quick else FULL).window_s,
                                         "hosts": "3 store hosts, the rollout's, the trainer's (2 ranks)"},
                 invariants_broken=broken, runs=runs)
    print(json.dumps({"metrics": metrics, "invariants_broken": broken}, indent=1))
    return 0 if not broken else 1


if __name__ == "__main__":
    raise SystemExit(main())
