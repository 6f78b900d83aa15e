"""Learning, measured: does lower staleness, corrected, reach a given reward sooner at the same final quality?

``python -m bench.learning [--quick] [--seeds 3] [--train-batches 30] [--arms A,B,...] [--runs DIR] [--reuse F.json]
--out F.json``

Each arm is one ``knit run`` of SmolLM2-135M-Instruct on the arithmetic task (its run defaults: exact-match
reward, ``add_small`` and ``add_large`` half each, B=4 groups of G=4, K=2, one trainer rank), the same seeds
for every arm:

* ``train_batch``: train-batch admission, ``ppo_rollout_old`` (the baseline);
* ``mini_batch``: mini-batch admission, ``ppo_rollout_old``;
* ``mini_batch_decoupled``: mini-batch admission, ``decoupled_ppo``;
* ``mini_batch_partial``: mini-batch admission, ``decoupled_ppo``, partial rollouts;
* ``colocated``: the paper's reference: generation waits for each train batch's weights (synchronous, on-policy
  within the train batch), so its architectural staleness is 0.

Per arm (means over the seeds): the mean reward of each train batch, against the train batch and against the
wall-clock time its last step ended (both plotted beside the JSON), the final reward (the last five train
batches pooled), the time each arm takes to reach train_batch's final reward (the first train batch where the mean
of the last five reaches it; per seed, then the median; the ratio to train_batch's own time is two medians over
the same seeds, those where the arm reached it), how much of the gap between train_batch and colocated each arm
closes (in final reward, and in the mean reward over all train batches; only where colocated is ahead of
train_batch, or behind it, in every seed: otherwise the gap is noise and no share of it is given; the per-seed
gaps are in ``metrics.colocated``), and the run's off-policy figures
(``summary.json``'s ``offpolicy``: importance weight, truncated and clipped fractions, k3 KL, token staleness)
and architectural staleness. ``--task-success``: the held-out success (``bench.task_success --quick``, prompts
drawn with :data:`EVAL_SEED`) of the starting checkpoint and of each run's trained weights (``knit run
--export-hf``), per data source.

The result keeps each run's record (``per_run``: curves, off-policy figures, held-out success, keyed
``<arm>-s<seed>``), so runs of hours are not lost with their folders: ``--reuse F.json`` (repeatable) takes the runs
an earlier result holds (same train-batch count) instead of running them again.

``--logger tensorboard,wandb,mlflow``: each run's per-step curves go to the trackers too (``knit run --logger``), one
tracker run per arm and seed.

``--quick``: one seed, 3 train batches, the arms ``train_batch`` and ``mini_batch_decoupled``: a check that the
bench runs end to end, far too short to answer the question.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench._common import pyplot, write_result
from bench.task_success import read_successes
from schemas import run_folder
from schemas.run_records import RankReportDocument
from schemas.run_summary import read_summary

ROOT = Path(__file__).resolve().parents[1]
ARMS: dict[str, tuple[str, str, bool]] = {
    "train_batch": ("train_batch", "ppo_rollout_old", False),
    "mini_batch": ("mini_batch", "ppo_rollout_old", False),
    "mini_batch_decoupled": ("mini_batch", "decoupled_ppo", False),
    "mini_batch_partial": ("mini_batch", "decoupled_ppo", True),
    "colocated": ("colocated", "ppo_rollout_old", False),
}
"""Arm -> (admission policy, objective, partial rollouts)."""
QUICK_ARMS = ("train_batch", "mini_batch_decoupled")
FINAL_WINDOW = 5
"""Train batches pooled into an arm's final reward."""
AFTER = "task_success_after.json"
"""A run folder's held-out success of its trained weights (``--task-success``)."""
EVAL_SEED = 10_000
"""Seed of the held-out prompts of ``--task-success`` (the runs draw theirs with seeds 0, 1, ...)."""


def run_arm(arm: str, seed: int, train_batches: int, out: Path, model_dir: Path | None, timeout_s: float, *,
            checkpoint_every: int = 0, logger: str | None = None) -> Path:
    """One ``knit run`` of ``arm``; returns its run folder (the policy's folder holds the trainer's reports). A folder
    that already holds the finished run (``summary.json``: an earlier invocation with the same ``--runs``) is
    read, not run again. ``logger``: the run's trackers (``knit run --logger``), its curves named by its folder."""
    if (out / run_folder.SUMMARY).is_file():
        return out
    policy, objective, partial = ARMS[arm]
    cmd = [sys.executable, "-m", "launcher", "run", "--plain", "--model", "smollm2-135m", "--policy", policy,
           "--objective", objective, "--train-batches", str(train_batches), "--seed", str(seed),
           "--timeout-s", str(timeout_s), "--out", str(out), "--checkpoint-every", str(checkpoint_every),
           "--partial-rollouts" if partial else "--no-partial-rollouts", "--export-hf"]
    if model_dir is not None:
        cmd += ["--model-dir", str(model_dir)]
    if logger:
        cmd += ["--logger", logger, "--project", "knittrans-learning"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s + 120, check=False)
    if done.returncode != 0:
        msg = f"knit run of {arm} (seed {seed}) exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        raise RuntimeError(msg)
    return out


def task_success(model: str, out: Path) -> dict[str, float]:
    """``bench.task_success --quick`` of ``model`` (a checkpoint folder, or ``smollm2-135m``) on prompts drawn with
    :data:`EVAL_SEED`, in a process of its own; its success per data source (read back when ``out`` exists)."""
    if not out.is_file():
        cmd = [sys.executable, "-m", "bench.task_success", "--quick", "--model", model, "--seed", str(EVAL_SEED),
               "--out", str(out)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode != 0:
            msg = f"bench.task_success of {model} exited {done.returncode}:\n{done.stderr[-3000:]}"
            raise RuntimeError(msg)
    return _successes(out)


def _successes(path: Path) -> dict[str, float]:
    """The success per data source of a ``bench.task_success`` result."""
    return {k: round(v, 4) for k, v in read_successes(path).items()}


def read_arm(folder: Path) -> dict[str, Any]:
    """One run's curves and figures: reward per train batch, the wall time each train batch ended, off-policy."""
    (result,) = read_summary(folder / run_folder.SUMMARY).policies.values()
    steps = run_folder.read_document(RankReportDocument, folder / "trainer_rank0.json").steps
    start = min(s.t_end - s.step_time_s for s in steps)
    ends: dict[int, float] = {}
    for s in steps:
        ends[s.train_batch] = max(ends.get(s.train_batch, 0.0), s.t_end - start)
    reward = [float(r) for r in result.reward_per_train_batch]
    after = folder / AFTER
    return {"reward": reward, "wall_s": [ends[b] for b in sorted(ends)][:len(reward)],
            "offpolicy": result.offpolicy.model_dump(), "arch_staleness_mean": result.arch_staleness_mean,
            "task_success_after": _successes(after) if after.is_file() else None}


def reused_runs(paths: Sequence[Path], train_batches: int) -> tuple[dict[str, dict[str, Any]], dict[str, float] | None]:
    """The per-run records (``<arm>-s<seed>`` -> record) and held-out success before training of earlier results;
    a result of another train-batch count is refused (its curves would not compare)."""
    records: dict[str, dict[str, Any]] = {}
    before = None
    for path in paths:
        doc = json.loads(path.read_text())
        if "per_run" not in doc:
            raise ValueError(f"{path} holds no per-run records (per_run): not a bench.learning result that keeps them")
        if doc["params"]["train_batches"] != train_batches:
            msg = f"{path} ran {doc['params']['train_batches']} train batches, this invocation {train_batches}"
            raise ValueError(msg)
        records.update(doc["per_run"])
        before = doc.get("task_success_before", before)
    return records, before


def _final(reward: Sequence[float]) -> float:
    tail = list(reward[-FINAL_WINDOW:])
    return sum(tail) / len(tail) if tail else float("nan")


def _mean(reward: Sequence[float]) -> float:
    return sum(reward) / len(reward) if reward else float("nan")


def moving_average(values: Sequence[float], window: int = FINAL_WINDOW) -> list[float]:
    """The mean of the last ``window`` values (fewer at the start) at each position."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]


def time_to_reach(run: dict[str, Any], target: float) -> float | None:
    """Seconds until the run's reward, as a moving average of :data:`FINAL_WINDOW` train batches (the window its
    final reward pools), first reaches ``target`` (None: never). Only full windows count."""
    smooth = moving_average(run["reward"])
    return next((w for i, (r, w) in enumerate(zip(smooth, run["wall_s"], strict=False))
                 if i + 1 >= min(FINAL_WINDOW, len(smooth)) and r >= target), None)


def gap_closed(arm: float, base: float, reference: float) -> float | None:
    """The share of the way from ``base`` (train_batch) to ``reference`` (colocated) that ``arm`` went (None where
    the two ends agree)."""
    return None if reference == base else round((arm - base) / (reference - base), 4)


def _median(values: Sequence[float]) -> float | None:
    v = sorted(values)
    return None if not v else (v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2)


def summarise(runs: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(metrics, ratios)``: per arm its seed-mean curves, final reward, time to train_batch's final reward, and
    the off-policy figures; ratios of each arm's median time to train_batch's."""
    metrics: dict[str, Any] = {}
    base = runs.get("train_batch", [])
    for arm, seeds in runs.items():
        n = min(len(r["reward"]) for r in seeds)
        curve = [sum(r["reward"][b] for r in seeds) / len(seeds) for b in range(n)]
        wall = [sum(r["wall_s"][b] for r in seeds) / len(seeds) for b in range(n)]
        reach = [time_to_reach(r, _final(b["reward"])) for r, b in zip(seeds, base, strict=False)]
        off = {k: [r["offpolicy"].get(k) for r in seeds] for k in seeds[0]["offpolicy"]}
        metrics[arm] = {
            "reward_per_train_batch": [round(x, 4) for x in curve],
            "wall_s_per_train_batch": [round(x, 1) for x in wall],
            "final_reward": round(_final(curve), 4),
            "mean_reward": round(_mean(curve), 4),
            "time_to_train_batch_final_s": _median([t for t in reach if t is not None]),
            "time_to_train_batch_final_s_per_seed": reach,
            "seeds_reaching_train_batch_final": sum(t is not None for t in reach),
            "arch_staleness_mean": [r["arch_staleness_mean"] for r in seeds],
            "offpolicy": off,
        }
        after = [r["task_success_after"] for r in seeds if r.get("task_success_after")]
        if after:  # per data source: the seeds' values and their mean
            metrics[arm]["task_success_after"] = {k: {"seeds": [a[k] for a in after],
                                                      "mean": round(sum(a[k] for a in after) / len(after), 4)}
                                                  for k in after[0]}
    ratios: dict[str, Any] = {}
    own = metrics.get("train_batch", {}).get("time_to_train_batch_final_s_per_seed", [])
    for arm, m in metrics.items():  # medians over the same seeds: those where the arm reached it
        pairs = [(t, b) for t, b in zip(m["time_to_train_batch_final_s_per_seed"], own, strict=False)
                 if t is not None and b]
        t, t_base = _median([t for t, _ in pairs]), _median([b for _, b in pairs])
        if arm != "train_batch" and t is not None and t_base:
            ratios[f"{arm}_time_to_reward_vs_train_batch"] = round(t / t_base, 4)
    if "train_batch" in metrics and "colocated" in metrics:  # the paper's question: how much of the gap closes
        for measure, of_run in (("final_reward", _final), ("mean_reward", _mean)):  # at the end; the whole curve
            gaps = [round(of_run(c["reward"]) - of_run(b["reward"]), 4)
                    for b, c in zip(runs["train_batch"], runs["colocated"], strict=False)]
            metrics["colocated"][f"{measure}_gap_to_train_batch_per_seed"] = gaps
            if not (all(g > 0 for g in gaps) or all(g < 0 for g in gaps)):
                continue  # the gap is not one the seeds agree on: a share of it would divide by noise
            base, ref = metrics["train_batch"][measure], metrics["colocated"][measure]
            for arm, m in metrics.items():
                closed = gap_closed(m[measure], base, ref)
                if arm not in ("train_batch", "colocated") and closed is not None:
                    ratios[f"{arm}_{measure}_gap_closed_vs_colocated"] = closed
    return metrics, ratios


def plot(metrics: dict[str, Any], path: Path) -> Path | None:
    """Reward per train batch against the train batch (left) and against wall-clock time (right), per arm."""
    plt = pyplot()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for arm, m in metrics.items():
        reward = m["reward_per_train_batch"]
        left.plot(range(len(reward)), reward, "o-", label=arm)
        right.plot(m["wall_s_per_train_batch"], reward, "o-", label=arm)
    left.set(xlabel="train batch", ylabel="mean reward (seed mean)", title="reward per train batch")
    right.set(xlabel="wall-clock time (s)", ylabel="mean reward (seed mean)", title="reward against time")
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.learning", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"1 seed, 3 train batches, arms {', '.join(QUICK_ARMS)}")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--train-batches", type=int, default=30)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    ap.add_argument("--model-dir", type=Path, default=None, help="the SmolLM2 checkpoint folder (knit run's default)")
    ap.add_argument("--timeout-s", type=float, default=7200.0, help="one arm's run is stopped after this long")
    ap.add_argument("--task-success", action="store_true",
                    help="also the held-out success (bench.task_success --quick) of the starting checkpoint and of "
                    "each run's trained weights (knit run --export-hf)")
    ap.add_argument("--runs", type=Path, default=None, help="where the run folders go (default: a temporary folder); "
                    "a run finished there by an earlier invocation is read, not run again")
    ap.add_argument("--reuse", type=Path, action="append", default=[],
                    help="an earlier result (repeatable): the runs it holds (per_run) are taken, not run again")
    ap.add_argument("--checkpoint-every", type=int, default=0,
                    help="the runs' checkpoint interval (default 0: only at the end; a checkpoint of SmolLM2 costs "
                    "about half a step on this machine, and a learning curve needs no resume)")
    ap.add_argument("--logger", default=None, metavar="A,B,...",
                    help="each run's trackers (knit run --logger: console, tensorboard, wandb, mlflow; W&B project and "
                    "MLflow experiment knittrans-learning), each run named <arm>-s<seed>: every arm's curves side by "
                    "side, e.g. tensorboard --logdir RUNS")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    arms = list(QUICK_ARMS) if args.quick else [a.strip() for a in args.arms.split(",")]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"unknown arms {unknown}; the arms are {list(ARMS)}")
    seeds = 1 if args.quick else args.seeds
    batches = 3 if args.quick else args.train_batches
    root = args.runs or Path(tempfile.mkdtemp(prefix="knit-learning-"))
    try:
        reused, before = reused_runs(args.reuse, batches)
    except (OSError, ValueError, KeyError) as exc:
        ap.error(f"--reuse: {exc}")
    runs: dict[str, list[dict[str, Any]]] = {}
    per_run: dict[str, dict[str, Any]] = {}
    if args.task_success and before is None:  # the starting checkpoint on the held-out prompts
        before = task_success(str(args.model_dir) if args.model_dir else "smollm2-135m",
                              root / "task_success_before.json")
    for seed in range(seeds):
        for arm in arms:  # seed-major: a machine slowing down over hours weighs on every arm alike
            key = f"{arm}-s{seed}"
            if key in reused:
                record = reused[key]
            else:
                folder = run_arm(arm, seed, batches, root / key, args.model_dir, args.timeout_s,
                                 checkpoint_every=args.checkpoint_every, logger=args.logger)
                if args.task_success:  # the trained policy on fresh prompts
                    task_success(str(folder / "final_hf"), folder / AFTER)
                record = read_arm(folder)
            per_run[key] = record
            runs.setdefault(arm, []).append(record)
            print(f"{arm} seed {seed}: reward per train batch {runs[arm][-1]['reward']}", flush=True)
    metrics, ratios = summarise(runs)
    extra: dict[str, Any] = {"per_run": per_run}
    if before is not None:
        extra["task_success_before"] = before
    figure = plot(metrics, Path(args.out).with_suffix(".png"))
    return write_result(args.out, metrics, ratios,
                        {"model": "smollm2-135m", "seeds": seeds, "train_batches": batches, "arms": arms,
                         "quick": args.quick, "final_window": FINAL_WINDOW},
                        figure=figure.name if figure else None, **extra)


if __name__ == "__main__":
    main()
