"""The report of a ``knit run``: per-policy figures from the run folder, ``summary.json`` and PNG plots.

Inputs (written by the processes of the run, see ``launcher.run``; read through ``schemas.run_folder`` as
their models): ``trainer_rank{r}.json`` (``RankReportDocument``: per-step records and what each rank received),
``consumed.parquet`` (``CONSUMED_FRAME``: the planner's consumed trajectories with their architectural staleness),
``rollout.json`` (``RolloutRecord``), ``resumes.jsonl`` (``ResumeRecord``). The figures are a
``schemas.run_summary.PolicySummary``; :func:`write_summary` writes ``summary.json`` (``RunSummary``).

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

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl

from launcher import offpolicy_report
from schemas import run_folder
from schemas.ledger import ResumeRecord
from schemas.run_frames import CONSUMED_FRAME
from schemas.run_records import RankReportDocument, RolloutRecord, StepLine
from schemas.run_summary import (
    ImageFigures,
    Latency,
    PolicySummary,
    RewardWindow,
    RunSummary,
    StepSeconds,
    StoreOutage,
    Throughput,
)

log = logging.getLogger(__name__)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return float(s[min(len(s) - 1, round(q * (len(s) - 1)))])


def rank_reports(folder: Path) -> list[RankReportDocument]:
    """The trainer ranks' reports of a run folder, by rank."""
    paths = sorted(folder.glob("trainer_rank*.json"), key=lambda p: int(p.stem.removeprefix("trainer_rank")))
    return [run_folder.read_document(RankReportDocument, p) for p in paths]


def read_consumed(folder: Path) -> pl.DataFrame:
    """The run's ``consumed.parquet`` (checked against ``schemas.run_frames.CONSUMED_FRAME``); empty when none."""
    path = folder / run_folder.CONSUMED
    if not path.exists():
        return pl.DataFrame()
    required = ("group_id", "step", "train_batch", "reward", "response_len", "arch_staleness")
    return pl.from_arrow(run_folder.read_frame(path, CONSUMED_FRAME, required=required))  # type: ignore[return-value]


def quota_violations(consumed: pl.DataFrame, quotas: Sequence[tuple[str, dict[str, int]]]) -> int:
    """(train batch, quota value) pairs of ``consumed`` whose distinct groups differ from the quota's count."""
    if consumed.height == 0:
        return 0
    bad = 0
    for t in consumed.get_column("train_batch").unique().to_list():
        sub = consumed.filter(pl.col("train_batch") == t)
        for column, counts in quotas:
            got = dict(sub.group_by(column).agg(pl.col("group_id").n_unique()).iter_rows())
            bad += sum(1 for value, n in counts.items() if got.get(value, 0) != n)
    return bad


def policy_summary(folder: Path, *, config: dict[str, Any], wall_s: float, metrics_urls: list[str] | None = None,
                   outages: Sequence[StoreOutage] = (),
                   quotas: Sequence[tuple[str, dict[str, int]]] = ()) -> PolicySummary:
    """The figures of one policy's run folder; ``quotas``: ``(column, value -> groups per train batch)`` each, for
    ``quota_violations``; ``config``: the run's config as its JSON document."""
    ranks = rank_reports(folder)
    consumed = read_consumed(folder)
    rollout_path = folder / run_folder.ROLLOUT_REPORT
    rollout = run_folder.read_document(RolloutRecord, rollout_path) if rollout_path.exists() else RolloutRecord()
    steps = ranks[0].steps if ranks else []
    return PolicySummary(
        policy=config.get("policy"),
        **_staleness_figures(consumed, quotas),
        **_delivery_figures(ranks, consumed),
        images=_image_figures(ranks, rollout),
        **_time_figures(steps, consumed),
        **_reward_figures(consumed),
        abs_logp_diff_first_step=round(float(steps[0].abs_logp_diff), 8) if steps else None,
        offpolicy=offpolicy_report.figures(steps, config.get("loss", {}).get("objective")),
        rollout=rollout.reported(),
        wall_s=round(wall_s, 2),
        store_outages=list(outages),
        store_restarts=sum(o.restarts for o in outages),
        metrics_urls=metrics_urls or [],
        config={k: (str(v) if isinstance(v, Path) else v) for k, v in config.items()},
    )


def _staleness_figures(consumed: pl.DataFrame, quotas: Sequence[tuple[str, dict[str, int]]]) -> dict[str, Any]:
    """How stale the consumed trajectories were (``admission.staleness``) and how often a quota was missed."""
    from admission.staleness import summary as staleness_summary

    stal = staleness_summary(consumed) if consumed.height else staleness_summary(pl.DataFrame())
    return {
        "arch_staleness_mean": round(stal.arch_mean, 4),
        "arch_staleness_token_weighted": round(stal.arch_token_weighted, 4),
        "arch_staleness_max": int(stal.arch_max),
        "signed_staleness_mean": round(stal.signed_mean, 4),
        "generation_span_mean": round(stal.span_mean, 4),
        "quota_violations": quota_violations(consumed, quotas),
        "total_staleness_mean": round(stal.total_mean, 4),
    }


def _delivery_figures(ranks: list[RankReportDocument], consumed: pl.DataFrame) -> dict[str, Any]:
    """What reached the trainer ranks, and how: rows (each once), steps, bytes, fetch latency, exposed wait."""
    steps = ranks[0].steps if ranks else []
    rows = [(c.group_id, c.sample_idx) for r in ranks for c in r.rows()]
    fetch_ms = [1e3 * f for r in ranks for s in r.steps for f in s.fetch_s]
    waits = {str(r.env.rank): sum(sum(s.exposed_wait_s) for s in r.steps) for r in ranks}
    return {
        "trajectories_consumed": int(consumed.height),
        "rows_received": len(rows),
        "duplicate_rows": len(rows) - len(set(rows)),
        "steps": len(steps),
        "final_version": int(steps[-1].version) if steps else 0,
        "bytes_per_rank": {str(r.env.rank): int(sum(s.bytes_fetched for s in r.steps)) for r in ranks},
        "driver_payload_bytes": 0,
        "transfer_latency_ms": Latency(mean=round(sum(fetch_ms) / len(fetch_ms), 3) if fetch_ms else 0.0,
                                       p50=round(_quantile(fetch_ms, 0.5), 3), p95=round(_quantile(fetch_ms, 0.95), 3),
                                       micro_batches=len(fetch_ms)),
        "exposed_wait_s": {k: round(v, 4) for k, v in waits.items()},
    }


def _image_figures(ranks: list[RankReportDocument], rollout: RolloutRecord) -> ImageFigures | None:
    """What a run with images stored, referenced, read and encoded (from its steps' ``encoder_passes``,
    ``distinct_images``, ``image_refs``, ``image_bytes``); None for a text run."""
    steps = [(str(r.env.rank), s.model_extra or {}) for r in ranks for s in r.steps]
    if not any("encoder_passes" in extra for _, extra in steps):
        return None

    def total(key: str) -> int:
        return int(sum(extra.get(key, 0) for _, extra in steps))

    distinct, passes = total("distinct_images"), total("encoder_passes")
    per_rank: dict[str, int] = {}
    for rank, extra in steps:
        per_rank[rank] = per_rank.get(rank, 0) + int(extra.get("image_bytes", 0))
    return ImageFigures(images_written=int((rollout.model_extra or {}).get("images_written", 0)),
                        image_refs=total("image_refs"), distinct_images=distinct, encoder_passes=passes,
                        encoder_passes_per_distinct_image=round(passes / distinct, 4) if distinct else 0.0,
                        image_bytes_per_rank=per_rank)


def _time_figures(steps: list[StepLine], consumed: pl.DataFrame) -> dict[str, Any]:
    """Rank 0's time: idle for a plan, the step and its publishing (medians), the training window, throughput."""
    idle = [s.plan_wait_s for s in steps[1:]]  # step 0 waits for start-up
    window = steps[-1].t_end - (steps[0].t_end - steps[0].step_time_s) if steps else 0.0
    tokens = int(consumed.get_column("response_len").sum()) if consumed.height else 0
    return {
        "trainer_idle_s": round(sum(idle), 3),
        # the step, what publishing cost the training thread, and the step's end to its version published on
        # every node (beside the next step)
        "step_s": StepSeconds(step=round(_quantile([s.step_time_s for s in steps], 0.5), 3),
                              publish_blocking=round(_quantile([s.publish_s or 0.0 for s in steps], 0.5), 3),
                              published_after=round(_quantile([s.publish_done_s or 0.0 for s in steps], 0.5), 3)),
        "training_window_s": round(window, 3),
        "throughput": Throughput(trajectories_per_s=round(consumed.height / window, 3) if window > 0 else 0.0,
                                 tokens_per_s=round(tokens / window, 1) if window > 0 else 0.0),
    }


def _reward_figures(consumed: pl.DataFrame) -> dict[str, Any]:
    """Mean reward per train batch with its 95% band; its trend and the pools of the first and last batches."""
    per_batch = (consumed.group_by("train_batch").agg(pl.col("reward").mean().alias("mean"), _ci95("reward"))
                 .sort("train_batch") if consumed.height else pl.DataFrame({"train_batch": [], "mean": [], "ci95": []}))
    reward, reward_batches = per_batch.get_column("mean").to_list(), per_batch.get_column("train_batch").to_list()
    result: dict[str, Any] = {
        "reward_per_train_batch": [round(float(r), 4) for r in reward],
        "reward_ci95_per_train_batch": [round(float(c), 4) for c in per_batch.get_column("ci95").to_list()],
    }
    if reward:
        result["reward_trend"] = round(float(reward[-1]) - float(reward[0]), 4)
        n = min(REWARD_WINDOW, len(reward))
        for name, batches in (("first", reward_batches[:n]), ("last", reward_batches[-n:])):
            mean, ci95 = consumed.filter(pl.col("train_batch").is_in(batches)).select(
                pl.col("reward").mean().alias("mean"), _ci95("reward")).row(0)
            result[f"reward_{name}{REWARD_WINDOW}"] = RewardWindow(mean=round(float(mean), 4),
                                                                   ci95=round(float(ci95 or 0.0), 4),
                                                                   train_batches=len(batches))
    return result


REWARD_WINDOW = 5
"""Train batches pooled at each end of a run for ``reward_first5`` / ``reward_last5`` (mean and its 95% band)."""


def _ci95(column: str) -> pl.Expr:
    """Half-width of the normal 95% confidence interval of ``column``'s mean (over the trajectories)."""
    return (1.96 * pl.col(column).std(ddof=1).fill_null(0.0) / pl.len().sqrt()).alias("ci95")


def write_policy_summary(out: Path, result: PolicySummary) -> Path:
    """``out/policy_summary.json``: one policy's figures."""
    return run_folder.write_document(result, out / run_folder.POLICY_SUMMARY)


def write_summary(out: Path, results: dict[str, PolicySummary]) -> RunSummary:
    """``out/summary.json``: every policy's figures, the staleness reduction and throughput ratio when
    train_batch and mini_batch both ran, and mini_batch's staleness over streaming's when it ran too."""
    doc = RunSummary(policies=results)
    tb, mb, st = results.get("train_batch"), results.get("mini_batch"), results.get("streaming")
    if tb is not None and mb is not None:
        base, new = tb.arch_staleness_mean, mb.arch_staleness_mean
        doc.arch_staleness_reduction = round((base - new) / base, 4) if base > 0 else 0.0
        tb_tp = tb.throughput.trajectories_per_s
        doc.throughput_ratio = round(mb.throughput.trajectories_per_s / tb_tp, 4) if tb_tp else None
        if st is not None and st.arch_staleness_mean:
            doc.mini_vs_streaming_arch = round(new / st.arch_staleness_mean, 4)
        plot_compare(out, results)
    if len(results) > 1:
        plot_rewards(out, results)
    out.mkdir(parents=True, exist_ok=True)
    run_folder.write_document(doc, out / run_folder.SUMMARY)
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


def plot_policy(folder: Path, result: PolicySummary) -> list[Path]:
    """The three PNGs of one policy's run; returns their paths."""
    plt = _pyplot()
    ranks = rank_reports(folder)
    steps = ranks[0].steps if ranks else []
    consumed = read_consumed(folder)
    name = result.policy or "run"
    paths = []

    fig, ax = plt.subplots(figsize=(7, 3.5))
    if consumed.height:
        per = consumed.group_by("step").agg(pl.col("arch_staleness").mean().alias("mean"),
                                            pl.col("arch_staleness").max().alias("max")).sort("step")
        x = per.get_column("step").to_list()
        ax.bar(x, per.get_column("mean").to_list(), color="tab:blue", label="mean")
        ax.plot(x, per.get_column("max").to_list(), "o--", color="tab:red", label="max")
        ax.legend()
    _seams(folder, ax)
    ax.set(xlabel="optimizer step", ylabel="architectural staleness (versions)",
           title=f"{name}: architectural staleness per step")
    paths.append(_save(fig, folder / "staleness_per_step.png"))

    fig, ax = plt.subplots(figsize=(7, 3.5))
    if steps:
        x = [s.step for s in steps]
        idle = [0.0] + [s.plan_wait_s for s in steps[1:]]
        wait = [sum(s.exposed_wait_s) for s in steps]
        compute = [max(0.0, s.step_time_s - w) for s, w in zip(steps, wait, strict=True)]
        publish = [s.publish_s or 0.0 for s in steps]
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
    reward = result.reward_per_train_batch
    ax.plot(range(len(reward)), reward, "o-")
    ax.set(xlabel="train batch", ylabel="mean reward", title=f"{name}: reward per train batch")
    paths.append(_save(fig, folder / "reward_per_train_batch.png"))
    paths.append(offpolicy_report.plot(plt, _save, steps, folder / "offpolicy_per_step.png", name))
    return paths


def _seams(folder: Path, ax: Any) -> None:
    """A dotted line before the first step of each resume (``resumes.jsonl``): the run's curve goes on across it."""
    for i, r in enumerate(run_folder.read_lines(ResumeRecord, folder / run_folder.RESUMES)):
        ax.axvline(r.step - 0.5, linestyle=":", color="black", label="resumed" if i == 0 else None)


def plot_rewards(out: Path, results: dict[str, PolicySummary]) -> Path:
    """Mean reward per train batch of every policy in one plot, each with its 95% band (over the batch's
    trajectories)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, result in results.items():
        mean = result.reward_per_train_batch
        band = result.reward_ci95_per_train_batch or [0.0] * len(mean)
        x = list(range(len(mean)))
        ax.plot(x, mean, "o-", label=name)
        ax.fill_between(x, [m - b for m, b in zip(mean, band, strict=True)],
                        [m + b for m, b in zip(mean, band, strict=True)], alpha=0.15)
    ax.legend()
    ax.set(xlabel="train batch", ylabel="mean reward (95% band)", title="reward per train batch")
    return _save(fig, out / "reward_compare.png")


def plot_compare(out: Path, results: dict[str, PolicySummary]) -> Path:
    """Architectural staleness per step of every policy in one plot."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, result in results.items():
        consumed = read_consumed(_folder(out, name, result))
        if not consumed.height:
            continue
        per = consumed.group_by("step").agg(pl.col("arch_staleness").mean()).sort("step")
        ax.plot(per.get_column("step").to_list(), per.get_column("arch_staleness").to_list(), "o-",
                label=f"{name} (mean {result.arch_staleness_mean:.2f})")
    ax.legend()
    ax.set(xlabel="optimizer step", ylabel="mean architectural staleness", title=" vs ".join(results))
    return _save(fig, out / "staleness_compare.png")


def _folder(out: Path, name: str, result: PolicySummary) -> Path:
    """The run folder of policy ``name``'s result (``--match-throughput`` keeps each try in a folder of its own)."""
    where = result.config.get("out")
    return Path(where) if where else out / name


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# ---- the printed table ------------------------------------------------------------------------

ROWS: tuple[str, ...] = (
    "arch. staleness mean", "arch. staleness token-weighted", "arch. staleness max", "generation span mean",
    "quota violations", "trajectories consumed", "optimizer steps / final version", "bytes moved per rank (MB)",
    "driver payload bytes", "transfer latency p50 / p95 (ms)", "exposed wait per rank (s)",
    "trainer idle, start-up excl. (s)", "step / publish blocking / published after (s)",
    "throughput (traj/s, tok/s)", "reward, first -> last train batch", "reward, first 5 -> last 5 (95% band)",
    "lookahead (groups)", "store restarts (down s)", "wall time (s)",
    "images stored / referenced; encoder passes per distinct image",
)
"""The labels of the summary table's rows, in order (:func:`table_rows`)."""


def table_rows(r: PolicySummary) -> list[tuple[str, str]]:
    """(label, text) rows of the summary table for one policy."""
    lat, tp, rewards = r.transfer_latency_ms, r.throughput, r.reward_per_train_batch
    a, b = r.reward_first5, r.reward_last5
    lookahead = str(r.config.get("lookahead_groups", "-"))
    if r.lookahead_search:
        lookahead += f" (tried {', '.join(str(t.lookahead) for t in r.lookahead_search)})"
    downs = ", ".join(f"{o.node}: {o.down_s}" + (" cut off" if o.cause == "unreachable" else "")
                      for o in r.store_outages)
    texts = (
        str(r.arch_staleness_mean), str(r.arch_staleness_token_weighted), str(r.arch_staleness_max),
        str(r.generation_span_mean), str(r.quota_violations), str(r.trajectories_consumed),
        f"{r.steps} / v{r.final_version}",
        ", ".join(f"r{k}: {v / 1e6:.3f}" for k, v in r.bytes_per_rank.items()),
        str(r.driver_payload_bytes), f"{lat.p50:.2f} / {lat.p95:.2f}",
        ", ".join(f"r{k}: {v:.3f}" for k, v in r.exposed_wait_s.items()), str(r.trainer_idle_s),
        " / ".join(f"{v:.2f}" for v in (r.step_s.step, r.step_s.publish_blocking, r.step_s.published_after)),
        f"{tp.trajectories_per_s:.2f}, {tp.tokens_per_s:.0f}",
        f"{rewards[0]:.3f} -> {rewards[-1]:.3f} ({len(rewards)} batches)" if rewards else "-",
        f"{a.mean:.3f}±{a.ci95:.3f} -> {b.mean:.3f}±{b.ci95:.3f}" if a and b else "-",
        lookahead, f"{r.store_restarts} ({downs})" if downs else "0", str(r.wall_s),
        (f"{r.images.images_written} / {r.images.image_refs}; {r.images.encoder_passes_per_distinct_image}"
         if r.images else "-"),
    )
    return list(zip(ROWS, texts, strict=True))
