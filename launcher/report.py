"""The report of a ``knit run``: per-policy figures from the run folder, ``summary.json`` and PNG plots.

Inputs (written by the processes of the run, see ``launcher.run``): ``trainer_rank{r}.json`` (per-step
metrics and what each rank received), ``consumed.parquet`` (the planner's consumed trajectories with
their architectural staleness), ``progress.jsonl``, ``rollout.json``, ``metadata.parquet`` (the
stores' metadata at the end), ``store_stats.json``.

Figures per policy (``policy_summary``):

* architectural staleness (``admission.staleness``): mean, token-weighted mean, max, signed mean;
* ``trajectories_consumed`` and ``duplicate_rows`` (rows a rank received twice; must be 0);
* ``bytes_per_rank`` (payload each trainer rank fetched from the stores, over Flight);
* ``driver_payload_bytes``: payload bytes that went through the driver (this process) or the
  planner; both only read metadata and stats, so it is 0 on the on-demand path;
* transfer latency (fetch time per micro-batch), exposed wait (time the step loop blocked on data),
  trainer idle (time waiting for an admissible mini-batch, start-up excluded);
* throughput (trajectories and tokens per second of the training window) and the reward trend
  (mean reward per train batch, with its 95% band, and pooled over the first and last 5 train batches);
* ``store_outages`` (each store node that died and was started again, or that did not answer while its
  process ran, ``cause`` ``unreachable``: ``launcher.stores.Outage``) and
  ``store_restarts`` (processes started again, over all nodes);
* ``offpolicy``: the objective and the steps' off-policy figures (``launcher.offpolicy_report``).

Plots: ``staleness_per_step.png``, ``time_breakdown.png``, ``reward_per_train_batch.png``,
``offpolicy_per_step.png``; with
several policies also ``reward_compare.png`` (and with train_batch and mini_batch ``staleness_compare.png``)
in the top folder.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl

from launcher import offpolicy_report

log = logging.getLogger(__name__)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return float(s[min(len(s) - 1, round(q * (len(s) - 1)))])


def _rank_reports(folder: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(folder.glob("trainer_rank*.json"), key=lambda p: int(p.stem.removeprefix("trainer_rank"))):
        out.append(json.loads(path.read_text()))
    return out


def quota_violations(consumed: pl.DataFrame, quotas: Sequence[tuple[str, dict[str, int]]]) -> int:
    """(train batch, quota value) pairs of ``consumed`` whose distinct groups differ from the quota's count."""
    if consumed.height == 0:
        return 0
    bad = 0
    for t in consumed["train_batch"].unique().to_list():
        sub = consumed.filter(pl.col("train_batch") == t)
        for column, counts in quotas:
            got = dict(sub.group_by(column).agg(pl.col("group_id").n_unique()).iter_rows())
            bad += sum(1 for value, n in counts.items() if got.get(value, 0) != n)
    return bad


def policy_summary(folder: Path, *, config: dict[str, Any], wall_s: float, metrics_urls: list[str] | None = None,
                   outages: list[dict[str, Any]] | None = None,
                   quotas: Sequence[tuple[str, dict[str, int]]] = ()) -> dict[str, Any]:
    """The figures of one policy's run folder (JSON-serialisable); ``quotas``: ``(column, value -> groups per
    train batch)`` each, for ``quota_violations``."""
    ranks = _rank_reports(folder)
    consumed_path = folder / "consumed.parquet"
    consumed = pl.read_parquet(consumed_path) if consumed_path.exists() else pl.DataFrame()
    rollout_path = folder / "rollout.json"
    rollout = json.loads(rollout_path.read_text()) if rollout_path.exists() else {}
    steps = ranks[0]["steps"] if ranks else []
    return {
        "policy": config.get("policy"),
        **_staleness_figures(consumed, quotas),
        **_delivery_figures(ranks, consumed),
        **_time_figures(steps, consumed),
        **_reward_figures(consumed),
        "abs_logp_diff_first_step": round(float(steps[0]["abs_logp_diff"]), 8) if steps else None,
        **offpolicy_report.figures(steps, config.get("loss", {}).get("objective")),
        "rollout": {k: rollout.get(k) for k in ("groups", "aborted_groups", "rows", "response_tokens", "tokens_per_s",
                                                "engine_start_s", "generate_s", "policy_versions", "bytes_written")},
        "wall_s": round(wall_s, 2),
        "store_outages": outages or [],
        "store_restarts": sum(int(o["restarts"]) for o in outages or []),
        "metrics_urls": metrics_urls or [],
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in config.items()},
    }


def _staleness_figures(consumed: pl.DataFrame, quotas: Sequence[tuple[str, dict[str, int]]]) -> dict[str, Any]:
    """How stale the consumed trajectories were (``admission.staleness``) and how often a quota was missed."""
    from admission.staleness import summary as staleness_summary

    stal = (staleness_summary(consumed) if consumed.height else staleness_summary(pl.DataFrame())).to_dict()
    return {
        "arch_staleness_mean": round(stal["arch_mean"], 4),
        "arch_staleness_token_weighted": round(stal["arch_token_weighted"], 4),
        "arch_staleness_max": int(stal["arch_max"]),
        "signed_staleness_mean": round(stal["signed_mean"], 4),
        "generation_span_mean": round(stal["span_mean"], 4),
        "quota_violations": quota_violations(consumed, quotas),
        "total_staleness_mean": round(stal["total_mean"], 4),
    }


def _delivery_figures(ranks: list[dict[str, Any]], consumed: pl.DataFrame) -> dict[str, Any]:
    """What reached the trainer ranks, and how: rows (each once), steps, bytes, fetch latency, exposed wait."""
    steps = ranks[0]["steps"] if ranks else []
    rows = [(c[2], c[3]) for r in ranks for c in r["consumed"] if c[0] == "row"]
    fetch_ms = [1e3 * f for r in ranks for s in r["steps"] for f in s["fetch_s"]]
    waits = {str(r["env"]["rank"]): sum(sum(s["exposed_wait_s"]) for s in r["steps"]) for r in ranks}
    return {
        "trajectories_consumed": int(consumed.height),
        "rows_received": len(rows),
        "duplicate_rows": len(rows) - len(set(rows)),
        "steps": len(steps),
        "final_version": int(steps[-1]["version"]) if steps else 0,
        "bytes_per_rank": {str(r["env"]["rank"]): int(sum(s["bytes_fetched"] for s in r["steps"])) for r in ranks},
        "driver_payload_bytes": 0,
        "transfer_latency_ms": {"mean": round(sum(fetch_ms) / len(fetch_ms), 3) if fetch_ms else 0.0,
                                "p50": round(_quantile(fetch_ms, 0.5), 3), "p95": round(_quantile(fetch_ms, 0.95), 3),
                                "micro_batches": len(fetch_ms)},
        "exposed_wait_s": {k: round(v, 4) for k, v in waits.items()},
    }


def _time_figures(steps: list[dict[str, Any]], consumed: pl.DataFrame) -> dict[str, Any]:
    """Rank 0's time: idle for a plan, the step and its publishing (medians), the training window, throughput."""
    idle = [s.get("plan_wait_s", 0.0) for s in steps[1:]]  # step 0 waits for start-up
    window = steps[-1]["t_end"] - (steps[0]["t_end"] - steps[0]["step_time_s"]) if steps else 0.0
    tokens = int(consumed["response_len"].sum()) if consumed.height else 0
    return {
        "trainer_idle_s": round(sum(idle), 3),
        # the step, what publishing cost the training thread, and the step's end to its version published on
        # every node (beside the next step)
        "step_s": {name: round(_quantile([float(s.get(key, 0.0)) for s in steps], 0.5), 3)
                   for name, key in (("step", "step_time_s"), ("publish_blocking", "publish_s"),
                                     ("published_after", "publish_done_s"))},
        "training_window_s": round(window, 3),
        "throughput": {"trajectories_per_s": round(consumed.height / window, 3) if window > 0 else 0.0,
                       "tokens_per_s": round(tokens / window, 1) if window > 0 else 0.0},
    }


def _reward_figures(consumed: pl.DataFrame) -> dict[str, Any]:
    """Mean reward per train batch with its 95% band; its trend and the pools of the first and last batches."""
    per_batch = (consumed.group_by("train_batch").agg(pl.col("reward").mean().alias("mean"), _ci95("reward"))
                 .sort("train_batch") if consumed.height else pl.DataFrame({"train_batch": [], "mean": [], "ci95": []}))
    reward, reward_batches = per_batch["mean"].to_list(), per_batch["train_batch"].to_list()
    result: dict[str, Any] = {
        "reward_per_train_batch": [round(float(r), 4) for r in reward],
        "reward_ci95_per_train_batch": [round(float(c), 4) for c in per_batch["ci95"].to_list()],
    }
    if reward:
        result["reward_trend"] = round(float(reward[-1]) - float(reward[0]), 4)
        n = min(REWARD_WINDOW, len(reward))
        for name, batches in (("first", reward_batches[:n]), ("last", reward_batches[-n:])):
            pooled = consumed.filter(pl.col("train_batch").is_in(batches)).select(
                pl.col("reward").mean().alias("mean"), _ci95("reward")).row(0, named=True)
            result[f"reward_{name}{REWARD_WINDOW}"] = {"mean": round(float(pooled["mean"]), 4),
                                                       "ci95": round(float(pooled["ci95"] or 0.0), 4),
                                                       "train_batches": len(batches)}
    return result


REWARD_WINDOW = 5
"""Train batches pooled at each end of a run for ``reward_first5`` / ``reward_last5`` (mean and its 95% band)."""


def _ci95(column: str) -> pl.Expr:
    """Half-width of the normal 95% confidence interval of ``column``'s mean (over the trajectories)."""
    return (1.96 * pl.col(column).std(ddof=1).fill_null(0.0) / pl.len().sqrt()).alias("ci95")


def write_summary(out: Path, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``out/summary.json``: every policy's figures, the staleness reduction and throughput ratio when
    train_batch and mini_batch both ran, and mini_batch's staleness over streaming's when it ran too."""
    doc: dict[str, Any] = {"policies": results}
    if "train_batch" in results and "mini_batch" in results:
        base = results["train_batch"]["arch_staleness_mean"]
        new = results["mini_batch"]["arch_staleness_mean"]
        doc["arch_staleness_reduction"] = round((base - new) / base, 4) if base > 0 else 0.0
        tb_tp = results["train_batch"]["throughput"]["trajectories_per_s"]
        doc["throughput_ratio"] = round(results["mini_batch"]["throughput"]["trajectories_per_s"] / tb_tp, 4) \
            if tb_tp else None
        if results.get("streaming", {}).get("arch_staleness_mean"):
            doc["mini_vs_streaming_arch"] = round(new / results["streaming"]["arch_staleness_mean"], 4)
        plot_compare(out, results)
    if len(results) > 1:
        plot_rewards(out, results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(doc, indent=1, default=str))
    return doc


# ---- plots ------------------------------------------------------------------------------------


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        msg = f"the run report's plots need matplotlib: pip install knittrans[run] ({exc})"
        raise ImportError(msg) from exc
    return plt


def plot_policy(folder: Path, result: dict[str, Any]) -> list[Path]:
    """The three PNGs of one policy's run; returns their paths."""
    plt = _pyplot()
    ranks = _rank_reports(folder)
    steps = ranks[0]["steps"] if ranks else []
    consumed_path = folder / "consumed.parquet"
    consumed = pl.read_parquet(consumed_path) if consumed_path.exists() else pl.DataFrame()
    name = result.get("policy") or "run"
    paths = []

    fig, ax = plt.subplots(figsize=(7, 3.5))
    if consumed.height:
        per = consumed.group_by("step").agg(pl.col("arch_staleness").mean().alias("mean"),
                                            pl.col("arch_staleness").max().alias("max")).sort("step")
        ax.bar(per["step"].to_list(), per["mean"].to_list(), color="tab:blue", label="mean")
        ax.plot(per["step"].to_list(), per["max"].to_list(), "o--", color="tab:red", label="max")
        ax.legend()
    _seams(folder, ax)
    ax.set(xlabel="optimizer step", ylabel="architectural staleness (versions)",
           title=f"{name}: architectural staleness per step")
    paths.append(_save(fig, folder / "staleness_per_step.png"))

    fig, ax = plt.subplots(figsize=(7, 3.5))
    if steps:
        x = [s["step"] for s in steps]
        idle = [0.0] + [s.get("plan_wait_s", 0.0) for s in steps[1:]]
        wait = [sum(s["exposed_wait_s"]) for s in steps]
        compute = [max(0.0, s["step_time_s"] - w) for s, w in zip(steps, wait, strict=True)]
        publish = [s.get("publish_s", 0.0) for s in steps]
        bottom = [0.0] * len(x)
        for label, vals, color in (("compute", compute, "tab:green"), ("exposed fetch wait", wait, "tab:orange"),
                                   ("publishing (encode; wait for the last)", publish, "tab:purple"),
                                   ("idle: waiting for admission", idle, "tab:gray")):
            ax.bar(x, vals, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.legend(fontsize=8)
    _seams(folder, ax)
    ax.set(xlabel="optimizer step", ylabel="seconds (rank 0)", title=f"{name}: time per step")
    paths.append(_save(fig, folder / "time_breakdown.png"))

    fig, ax = plt.subplots(figsize=(7, 3.5))
    reward = result.get("reward_per_train_batch") or []
    ax.plot(range(len(reward)), reward, "o-")
    ax.set(xlabel="train batch", ylabel="mean reward", title=f"{name}: reward per train batch")
    paths.append(_save(fig, folder / "reward_per_train_batch.png"))
    paths.append(offpolicy_report.plot(plt, _save, steps, folder / "offpolicy_per_step.png", name))
    return paths


def _seams(folder: Path, ax: Any) -> None:
    """A dotted line before the first step of each resume (``resumes.jsonl``): the run's curve goes on across it."""
    path = folder / "resumes.jsonl"
    lines = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
    for i, r in enumerate(lines):
        ax.axvline(r["step"] - 0.5, linestyle=":", color="black", label="resumed" if i == 0 else None)


def plot_rewards(out: Path, results: dict[str, dict[str, Any]]) -> Path:
    """Mean reward per train batch of every policy in one plot, each with its 95% band (over the batch's
    trajectories)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, result in results.items():
        mean = result.get("reward_per_train_batch") or []
        band = result.get("reward_ci95_per_train_batch") or [0.0] * len(mean)
        x = list(range(len(mean)))
        ax.plot(x, mean, "o-", label=name)
        ax.fill_between(x, [m - b for m, b in zip(mean, band, strict=True)],
                        [m + b for m, b in zip(mean, band, strict=True)], alpha=0.15)
    ax.legend()
    ax.set(xlabel="train batch", ylabel="mean reward (95% band)", title="reward per train batch")
    return _save(fig, out / "reward_compare.png")


def plot_compare(out: Path, results: dict[str, dict[str, Any]]) -> Path:
    """Architectural staleness per step of every policy in one plot."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name in results:
        path = _folder(out, name, results[name]) / "consumed.parquet"
        if not path.exists():
            continue
        per = pl.read_parquet(path).group_by("step").agg(pl.col("arch_staleness").mean()).sort("step")
        ax.plot(per["step"].to_list(), per["arch_staleness"].to_list(), "o-",
                label=f"{name} (mean {results[name]['arch_staleness_mean']:.2f})")
    ax.legend()
    ax.set(xlabel="optimizer step", ylabel="mean architectural staleness", title=" vs ".join(results))
    return _save(fig, out / "staleness_compare.png")


def _folder(out: Path, name: str, result: dict[str, Any]) -> Path:
    """The run folder of policy ``name``'s result (``--match-throughput`` keeps each try in a folder of its own)."""
    where = result.get("config", {}).get("out")
    return Path(where) if where else out / name


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# ---- the printed table ------------------------------------------------------------------------

ROWS: tuple[tuple[str, str], ...] = (
    ("arch. staleness mean", "arch_staleness_mean"),
    ("arch. staleness token-weighted", "arch_staleness_token_weighted"),
    ("arch. staleness max", "arch_staleness_max"),
    ("generation span mean", "generation_span_mean"),
    ("quota violations", "quota_violations"),
    ("trajectories consumed", "trajectories_consumed"),
    ("optimizer steps / final version", "steps_version"),
    ("bytes moved per rank (MB)", "bytes_per_rank"),
    ("driver payload bytes", "driver_payload_bytes"),
    ("transfer latency p50 / p95 (ms)", "latency"),
    ("exposed wait per rank (s)", "exposed_wait_s"),
    ("trainer idle, start-up excl. (s)", "trainer_idle_s"),
    ("step / publish blocking / published after (s)", "step_s"),
    ("throughput (traj/s, tok/s)", "throughput"),
    ("reward, first -> last train batch", "reward_per_train_batch"),
    ("reward, first 5 -> last 5 (95% band)", "reward_windows"),
    ("lookahead (groups)", "lookahead"),
    ("store restarts (down s)", "store_outages"),
    ("wall time (s)", "wall_s"),
)


def table_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) rows of the summary table for one policy."""
    out = []
    for label, key in ROWS:
        if key == "steps_version":
            text = f"{result['steps']} / v{result['final_version']}"
        elif key == "bytes_per_rank":
            text = ", ".join(f"r{k}: {v / 1e6:.3f}" for k, v in result[key].items())
        elif key == "latency":
            lat = result["transfer_latency_ms"]
            text = f"{lat['p50']:.2f} / {lat['p95']:.2f}"
        elif key == "exposed_wait_s":
            text = ", ".join(f"r{k}: {v:.3f}" for k, v in result[key].items())
        elif key == "step_s":
            text = " / ".join(f"{v:.2f}" for v in result[key].values())
        elif key == "throughput":
            text = f"{result[key]['trajectories_per_s']:.2f}, {result[key]['tokens_per_s']:.0f}"
        elif key == "reward_per_train_batch":
            rewards = result[key]
            text = f"{rewards[0]:.3f} -> {rewards[-1]:.3f} ({len(rewards)} batches)" if rewards else "-"
        elif key == "reward_windows":
            a, b = result.get(f"reward_first{REWARD_WINDOW}"), result.get(f"reward_last{REWARD_WINDOW}")
            text = f"{a['mean']:.3f}±{a['ci95']:.3f} -> {b['mean']:.3f}±{b['ci95']:.3f}" if a and b else "-"
        elif key == "lookahead":
            tries = result.get("lookahead_search")
            text = str(result.get("config", {}).get("lookahead_groups", "-"))
            if tries:
                text += f" (tried {', '.join(str(t['lookahead']) for t in tries)})"
        elif key == "store_outages":
            downs = ", ".join(f"{o['node']}: {o['down_s']}" + (" cut off" if o.get("cause") == "unreachable" else "")
                              for o in result[key])
            text = f"{result['store_restarts']} ({downs})" if downs else "0"
        else:
            text = str(result[key])
        out.append((label, text))
    return out
