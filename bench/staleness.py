"""Architectural-staleness simulator: train-batch vs mini-batch admission at matched throughput.

``python -m bench.staleness [--quick] [--math-sigma 0.9] --out results/staleness.json``

Variant flags (to locate what bounds the reduction): ``--math-sigma`` (tail length), ``--sync
per_train_batch`` (sync granularity), ``--version-at start`` (version semantics: no in-flight weight
updates), ``--trainer-slowdown F`` (optimizer-step time relative to generation latency: F times the
calibrated trainer), ``--loader-order slow_first``. Each run reports the lookahead search it did.

A discrete-event simulation of a disaggregated RL pipeline that calls the production planner
(``admission.Planner``) at event times; the three policies run on the same seeds (same prompts and
the same response lengths per prompt).

Model:

* **Data loader**: yields train-batch-sized chunks of B prompts in the quota mix (B/2 ``math``,
  B/2 ``chat``, shuffled). Every prompt has G responses whose lengths are drawn up front: ``math``
  lognormal with median 1200 tokens and sigma 0.9 (``--math-sigma``), ``chat`` median 400, sigma
  0.5, both capped at 8192; prompts 64-512 tokens.
* **Rollout**: ``slots`` (512) concurrent sequences; a group starts when G slots are free; each
  sequence occupies its slot for ``gen_s_per_token * response_len`` seconds; a group is complete
  when all G sequences are. New weights reach the running engine (in-flight weight updates, as the
  rollout worker in ``connectors.rollout`` does), so a group records the version at its completion
  as ``policy_version`` and the version at its start as ``policy_version_min``
  (``--version-at start`` records the start version instead).
* **Lookahead**: at most L groups may be dispatched but not yet trained. ``train_batch`` runs
  one-step-off-policy with L = 2B; ``mini_batch`` uses the smallest L (searched in steps of one
  mini-batch, then bisected down to one group) whose throughput is at least ``train_batch``'s
  (matched throughput); ``colocated`` dispatches train batch t only when the weights of version
  tK exist (L = B, rollout and trainer alternate).
* **Planner**: called after every group completion and every optimizer step, with the metadata
  rows of completed, not yet admitted groups and, as ``inflight``, the groups dispatched but not
  complete plus the loader's prompts committed for the current and next chunk (the loader yields
  the quota mix, so those prompts will arrive). Cheap path: the call is skipped when fewer
  completed unadmitted groups exist than the policy's admission unit (B/K or B), where the planner
  itself could not admit anything.
* **Trainer**: runs admitted mini-batches in step order; a step takes ``train_s_per_token`` times
  the tokens (prompt + response) of its most loaded DP rank. ``train_s_per_token`` is calibrated on
  seed 0 so that the trainer is busy ~92% of the time under ``train_batch`` (the fastest trainer
  that still keeps >= 90% busy). After every step (``--sync per_step``, default) or after every
  train batch (``per_train_batch``) the new weights reach the rollout (version = steps applied).
* **Metrics**: architectural staleness from the planner's own accounting (mean, token-weighted,
  max, signed mean); quota violations (train batches whose ``data_source`` counts differ from the
  quota); trainer idle fraction and throughput (trajectories per simulated second) measured in
  steady state, from the end of train batch 0 to the end of the run.
"""

from __future__ import annotations

import argparse
import heapq
import logging
import statistics
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from admission import AdmissionConfig, Planner, PlannerState, Quota, plan
from bench._common import timer, write_result

log = logging.getLogger(__name__)
SOURCES = ("math", "chat")


@dataclass(kw_only=True, slots=True)
class SimParams:
    """Workload and pipeline parameters of one simulation."""

    groups: int = 64
    """B: prompt groups per train batch."""
    group_size: int = 8
    """G."""
    mini_batches: int = 4
    """K."""
    dp_ranks: int = 2
    """D."""
    train_batches: int = 20
    """Train batches simulated."""
    slots: int = 512
    """Concurrent rollout sequences."""
    math_median: float = 1200.0
    math_sigma: float = 0.9
    chat_median: float = 400.0
    chat_sigma: float = 0.5
    max_len: int = 8192
    gen_s_per_token: float = 1e-3
    """Rollout seconds per generated token of one sequence."""
    train_s_per_token: float = 1e-5
    """Trainer seconds per token of the most loaded rank (calibrated)."""
    token_budget: int = 16384
    sync: str = "per_step"
    """``per_step`` or ``per_train_batch``."""
    version_at: str = "complete"
    """Recorded ``policy_version`` of a group: the rollout version when it ``complete``s (default: what the
    project's rollout worker records, since it loads each new version into the running engine, so the
    newest weights produced the last tokens; ``policy_version_min`` stays the start version), or when it
    ``start``s (variant: a rollout that never updates weights under running requests)."""
    loader_order: str = "shuffled"
    """Dispatch order: ``shuffled`` (default), ``slow_first`` (math before chat inside a chunk) or
    ``math_ahead`` (each chunk's math dispatched one chunk early; see :func:`_dispatch_order`)."""
    trainer_slowdown: float = 1.0
    """Multiplier on the calibrated trainer time (> 1: trainer-bound regime)."""


@dataclass(slots=True)
class _Prompt:
    source: str
    prompt_len: int
    lengths: np.ndarray
    rewards: np.ndarray


def make_prompts(p: SimParams, seed: int, chunks: int) -> list[list[_Prompt]]:
    """The loader's chunks (one per train batch) in the quota mix, with response lengths drawn up front."""
    rng = np.random.default_rng(seed)
    out = []
    half = p.groups // 2
    for _ in range(chunks):
        srcs = np.array(["math"] * half + ["chat"] * (p.groups - half))
        rng.shuffle(srcs)
        if p.loader_order == "slow_first":
            srcs = np.array(sorted(srcs, key=lambda s: s != "math"))
        chunk = []
        for s in srcs:
            med, sig = (p.math_median, p.math_sigma) if s == "math" else (p.chat_median, p.chat_sigma)
            lens = np.minimum(np.rint(med * np.exp(sig * rng.standard_normal(p.group_size))), p.max_len)
            lens = np.maximum(lens, 1).astype(np.int64)
            chunk.append(_Prompt(str(s), int(rng.integers(64, 513)), lens,
                                 (rng.random(p.group_size) < rng.random()).astype(np.float64)))
        out.append(chunk)
    return out


def _dispatch_order(prompts: list[list[_Prompt]], p: SimParams) -> list[_Prompt]:
    """The order the loader hands prompts to rollout; ``math_ahead`` dispatches each chunk's math one chunk
    early (block 0 = math of chunks 0 and 1, block j = chat of chunk j-1 + math of chunk j+1); ``colocated``
    always dispatches chunk by chunk."""
    if p.loader_order != "math_ahead":
        return [pr for ch in prompts for pr in ch]
    maths = [[pr for pr in ch if pr.source == "math"] for ch in prompts]
    chats = [[pr for pr in ch if pr.source != "math"] for ch in prompts]
    out = maths[0] + maths[1]
    for j in range(1, len(prompts) - 1):
        out += [x for pair in zip(chats[j - 1], maths[j + 1], strict=False) for x in pair]
    return out


def _config(p: SimParams, policy: str) -> AdmissionConfig:
    return AdmissionConfig(train_batch_groups=p.groups, group_size=p.group_size, mini_batches=p.mini_batches,
                           dp_ranks=p.dp_ranks, token_budget=p.token_budget, policy=policy,  # type: ignore[arg-type]
                           quotas=(Quota(column="data_source", shares={"math": 0.5, "chat": 0.5}),))


def simulate(p: SimParams, policy: str, lookahead: int, seed: int) -> dict[str, Any]:
    """Run one simulation; returns metrics and the per-step staleness."""
    chunks = p.train_batches + 3
    prompts = make_prompts(p, seed, chunks)
    cfg = _config(p, policy)
    planner = Planner(cfg)
    b, g, k_mb = p.groups, p.group_size, p.mini_batches
    m = cfg.groups_per_mini_batch
    unit = m if policy == "mini_batch" else b
    total_steps = p.train_batches * k_mb

    now = 0.0
    events: list[tuple[float, int, str, int]] = []
    counter = 0
    free_slots = p.slots
    version = 0  # rollout weights
    steps_done = 0
    next_prompt = 0  # flat index into the loader
    queue: deque[int] = deque()  # dispatched, waiting for slots
    started: dict[int, int] = {}  # group -> version
    remaining: dict[int, int] = {}  # group -> sequences still generating
    dispatched_untrained = 0
    completed_rows: dict[int, dict[str, np.ndarray]] = {}  # completed, not admitted
    inflight_src: Counter[str] = Counter()
    plans: deque[Any] = deque()
    trainer_busy_until: float | None = None
    busy_intervals: list[tuple[float, float]] = []
    step_end: list[float] = []
    seq_no = 0
    flat = _dispatch_order(prompts, p) if policy != "colocated" else [pr for ch in prompts for pr in ch]
    calls = 0
    slot_busy: list[tuple[float, float]] = []  # (start, end) of every sequence
    start_time: dict[int, float] = {}
    latency: dict[str, list[float]] = {src: [] for src in SOURCES}

    def push(t: float, kind: str, x: int) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, kind, x))

    def dispatch() -> None:
        nonlocal next_prompt, dispatched_untrained
        while dispatched_untrained < lookahead and next_prompt < len(flat):
            if policy == "colocated" and steps_done < (next_prompt // b) * k_mb:
                break
            queue.append(next_prompt)
            inflight_src[flat[next_prompt].source] += 1
            next_prompt += 1
            dispatched_untrained += 1

    def start_groups() -> None:
        nonlocal free_slots
        while queue and free_slots >= g:
            gi = queue.popleft()
            free_slots -= g
            started[gi] = version
            start_time[gi] = now
            remaining[gi] = g
            for length in flat[gi].lengths:
                push(now + float(length) * p.gen_s_per_token, "seq", gi)
                slot_busy.append((now, now + float(length) * p.gen_s_per_token))

    def call_planner() -> None:
        nonlocal seq_no, calls
        if len(completed_rows) < unit:
            return
        calls += 1
        cols = list(next(iter(completed_rows.values())))
        frame = pl.DataFrame({c: np.concatenate([r[c] for r in completed_rows.values()]) for c in cols})
        # committed supply: in flight + the loader's prompts up to the end of the next chunk
        horizon = min(len(flat), (next_prompt // b + 2) * b)
        future = Counter(flat[i].source for i in range(next_prompt, horizon))
        inflight = {s: inflight_src[s] + future[s] for s in SOURCES}
        new = planner.update(frame, inflight=inflight, current_version=version)
        for pl_ in new:
            for gid in pl_.group_ids:
                completed_rows.pop(int(gid), None)
            plans.append(pl_)
        if new:
            maybe_train()

    def maybe_train() -> None:
        nonlocal trainer_busy_until
        if trainer_busy_until is not None or not plans:
            return
        mb = plans[0]
        rank_tokens = max(sum(mbx.tokens for mbx in r.micro_batches) for r in mb.ranks)
        dur = rank_tokens * p.train_s_per_token
        trainer_busy_until = now + dur
        busy_intervals.append((now, now + dur))
        push(now + dur, "step", mb.step)

    dispatch()
    start_groups()
    while events and steps_done < total_steps:
        now, _, kind, x = heapq.heappop(events)
        if kind == "seq":
            free_slots += 1
            remaining[x] -= 1
            if remaining[x] == 0:
                del remaining[x]
                pr = flat[x]
                inflight_src[pr.source] -= 1
                v0 = started.pop(x)
                latency[pr.source].append(now - start_time.pop(x))
                v = version if p.version_at == "complete" else v0
                seq_no += g
                completed_rows[x] = {
                    "seq": np.arange(seq_no - g, seq_no, dtype=np.int64),
                    "group_id": np.full(g, str(x)), "sample_idx": np.arange(g, dtype=np.int32),
                    "policy_version": np.full(g, v, dtype=np.int64),
                    "policy_version_min": np.full(g, v0, dtype=np.int64), "data_source": np.full(g, pr.source),
                    "prompt_len": np.full(g, pr.prompt_len, dtype=np.int32),
                    "response_len": pr.lengths.astype(np.int32), "reward": pr.rewards,
                    "status": np.full(g, "completed"),
                }
                call_planner()
            start_groups()
        else:  # optimizer step done
            plans.popleft()
            trainer_busy_until = None
            steps_done += 1
            step_end.append(now)
            dispatched_untrained -= m
            if p.sync == "per_step" or steps_done % k_mb == 0:
                version = steps_done
            dispatch()
            start_groups()
            call_planner()
            maybe_train()

    consumed = planner.consumed_frame().filter(pl.col("step") < total_steps)
    rep = planner.staleness_report()
    from admission import summary  # local: same accounting on the trimmed frame

    run = summary(consumed)
    if len(step_end) <= k_mb:  # the pipeline deadlocked (lookahead held by groups no quota admits)
        log.warning("%s with L=%d deadlocked after %d steps", policy, lookahead, len(step_end))
        return {"arch_mean": run["arch_mean"], "arch_token_weighted": run["arch_token_weighted"],
                "arch_max": run["arch_max"], "signed_mean": run["signed_mean"], "quota_violations": 0,
                "trainer_idle_fraction": 1.0, "throughput": 0.0, "rollout_slot_utilization": 0.0,
                "step_s_mean": float("nan"), "math_group_latency_s_mean": float("nan"),
                "chat_group_latency_s_mean": float("nan"), "sim_seconds": now, "planner_calls": calls,
                "per_step_arch_mean": [r["arch_mean"] for r in rep["per_step"]]}
    t0, t1 = step_end[k_mb - 1], step_end[-1]
    busy = sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in busy_intervals)
    trained = (len(step_end) - k_mb) * m * g
    slot_s = sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in slot_busy)
    viol = 0
    for t in range(p.train_batches):
        sub = consumed.filter(pl.col("train_batch") == t)
        cnt = dict(sub.group_by("data_source").agg(pl.col("group_id").n_unique()).iter_rows())
        viol += sum(1 for s in SOURCES if cnt.get(s, 0) != b // 2)
    return {
        "arch_mean": run["arch_mean"], "arch_token_weighted": run["arch_token_weighted"],
        "arch_max": run["arch_max"], "signed_mean": run["signed_mean"],
        "quota_violations": viol, "trainer_idle_fraction": 1.0 - busy / (t1 - t0),
        "throughput": trained / (t1 - t0),
        "rollout_slot_utilization": slot_s / (p.slots * (t1 - t0)),
        "step_s_mean": (t1 - t0) / (len(step_end) - k_mb),
        "math_group_latency_s_mean": float(np.mean(latency["math"])),
        "chat_group_latency_s_mean": float(np.mean(latency["chat"])), "sim_seconds": t1, "planner_calls": calls,
        "per_step_arch_mean": [r["arch_mean"] for r in rep["per_step"] if r["step"] < total_steps],
    }


def run_policy(p: SimParams, policy: str, lookahead: int, seeds: list[int]) -> dict[str, Any]:
    """Mean of :func:`simulate` over seeds (per-step series from the first seed)."""
    rs = [simulate(p, policy, lookahead, s) for s in seeds]
    out: dict[str, Any] = {key: float(np.mean([r[key] for r in rs])) for key in rs[0] if key != "per_step_arch_mean"}
    out["arch_max"] = float(max(r["arch_max"] for r in rs))
    out["quota_violations"] = int(sum(r["quota_violations"] for r in rs))
    out["per_step_arch_mean"] = rs[0]["per_step_arch_mean"]
    out["lookahead_groups"] = lookahead
    return out


def calibrate(p: SimParams, seed: int, target_busy: float) -> float:
    """Smallest trainer s/token (fastest trainer) keeping the train_batch trainer >= target busy (bisection)."""
    lo, hi = 1e-7, 1e-3
    for _ in range(14):
        mid = (lo * hi) ** 0.5
        p.train_s_per_token = mid
        idle = simulate(p, "train_batch", 2 * p.groups, seed)["trainer_idle_fraction"]
        if 1.0 - idle >= target_busy:
            hi = mid
        else:
            lo = mid
    return hi


def plan_ms_p50_100k(reps: int = 30) -> float:
    """p50 ms of one admission decision with 100k trajectories in the metadata frame."""
    rng = np.random.default_rng(0)
    n, g = 100_000, 8
    ng = n // g
    gids = np.repeat(np.array([f"g{i:06d}" for i in range(ng)]), g)
    meta = pl.DataFrame({
        "seq": np.arange(n), "node": np.repeat(np.array([f"node{i % 4}" for i in range(ng)]), g),
        "group_id": gids, "sample_idx": np.tile(np.arange(g, dtype=np.int32), ng),
        "policy_version": np.repeat(np.arange(ng) // 64, g), "policy_version_min": np.repeat(np.arange(ng) // 64, g),
        "data_source": np.repeat(rng.choice(list(SOURCES), ng), g),
        "prompt_len": rng.integers(64, 512, n).astype(np.int32),
        "response_len": rng.integers(50, 4000, n).astype(np.int32),
        "reward": rng.random(n).astype(np.float32), "finish_reason": np.full(n, "stop"),
        "status": np.full(n, "completed"),
    })
    cfg = _config(SimParams(), "mini_batch")
    # a long run: all but the newest 20 groups admitted already; one mini-batch is admissible now
    state = PlannerState(train_batch=190, admitted=frozenset(f"g{i:06d}" for i in range(ng - 20)))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        res = plan(meta, state, cfg, inflight={"math": 64, "chat": 64}, current_version=760)
        ts.append((time.perf_counter() - t0) * 1e3)
        if len(res.plans) != 1:
            msg = f"expected one admitted mini-batch, got {len(res.plans)}"
            raise RuntimeError(msg)
    return float(statistics.median(ts))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6 train batches instead of 20")
    ap.add_argument("--out", required=True, help="result JSON path (PNG written beside it)")
    ap.add_argument("--math-sigma", type=float, default=0.9, help="lognormal sigma of math response lengths")
    ap.add_argument("--sync", choices=["per_step", "per_train_batch"], default="per_step")
    ap.add_argument("--version-at", choices=["start", "complete"], default="complete",
                    help="policy_version of a group: rollout version at its completion (default, in-flight weight "
                         "updates as the rollout worker does) or at its start")
    ap.add_argument("--trainer-slowdown", type=float, default=1.0,
                    help="multiply the calibrated trainer time (variant: trainer-bound pipeline)")
    ap.add_argument("--loader-order", choices=["shuffled", "slow_first", "math_ahead"], default="shuffled",
                    help="dispatch order: slow_first = math before chat in a chunk; math_ahead = math one chunk early")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--train-batches", type=int, default=None)
    args = ap.parse_args(argv)
    p = SimParams(train_batches=args.train_batches or (6 if args.quick else 20), math_sigma=args.math_sigma,
                  sync=args.sync, version_at=args.version_at,
                  loader_order=args.loader_order)
    seeds = list(range(args.seeds))
    with timer() as wall:
        p.train_s_per_token = args.trainer_slowdown * calibrate(
            SimParams(**{**asdict(p), "train_batches": min(p.train_batches, 6)}), 0, target_busy=0.92)
        p.trainer_slowdown = args.trainer_slowdown
        b, m = p.groups, p.groups // p.mini_batches
        res: dict[str, dict[str, Any]] = {
            "train_batch": run_policy(p, "train_batch", 2 * b, seeds),
            "colocated": run_policy(p, "colocated", b, seeds),
        }
        search: list[dict[str, float]] = []

        def try_lookahead(lookahead: int) -> dict[str, Any]:
            r = run_policy(p, "mini_batch", lookahead, seeds)
            search.append({"lookahead": lookahead, "throughput": r["throughput"], "arch_mean": r["arch_mean"]})
            print(f"  mini_batch L={lookahead}: throughput {r['throughput']:.2f} vs train_batch "
                  f"{res['train_batch']['throughput']:.2f}, arch_mean {r['arch_mean']:.3f}", flush=True)
            return r

        def matched(r: dict[str, Any]) -> bool:
            return bool(r["throughput"] >= res["train_batch"]["throughput"])

        # coarse: steps of one mini-batch; then bisect down to one group between the last miss and the hit
        found, low = None, 0
        for lookahead in range(m, 4 * b + 1, m):
            r = try_lookahead(lookahead)
            if matched(r):
                found = r
                break
            low = lookahead
        if found is None:
            found = r
        else:
            high = found["lookahead_groups"]
            while high - low > 1:
                mid = (low + high) // 2
                r = try_lookahead(mid)
                if matched(r):
                    found, high = r, mid
                else:
                    low = mid
        res["mini_batch"] = found
        plan_ms = plan_ms_p50_100k()
    tb, mb = res["train_batch"], res["mini_batch"]
    metrics: dict[str, Any] = {
        f"{pol}_{key}": val for pol, r in res.items() for key, val in r.items() if key != "per_step_arch_mean"
    }
    metrics.update({
        "mini_batch_lookahead_groups": mb["lookahead_groups"],
        "quota_violations": int(sum(r["quota_violations"] for r in res.values())),
        "plan_ms_p50_100k": plan_ms,
        "wall_s": wall[0],
        "lookahead_search": search,
    })
    ratios = {
        "arch_staleness_reduction": 1.0 - mb["arch_mean"] / tb["arch_mean"] if tb["arch_mean"] else 0.0,
        "arch_staleness_reduction_token_weighted":
            1.0 - mb["arch_token_weighted"] / tb["arch_token_weighted"] if tb["arch_token_weighted"] else 0.0,
        "throughput_mini_vs_train": mb["throughput"] / tb["throughput"],
    }
    params = {**asdict(p), "seeds": seeds, "quick": args.quick,
              "lookahead": {"train_batch": 2 * p.groups, "colocated": p.groups, "mini_batch": mb["lookahead_groups"]}}
    doc = write_result(args.out, metrics, ratios, params,
                       per_step_arch_mean={k: v["per_step_arch_mean"] for k, v in res.items()})
    _plot(Path(args.out).with_suffix(".png"), res)
    print(f"arch staleness mean: train_batch {tb['arch_mean']:.3f}  mini_batch {mb['arch_mean']:.3f}  "
          f"colocated {res['colocated']['arch_mean']:.3f}")
    print(f"reduction {ratios['arch_staleness_reduction']:.3f}  throughput mini/train "
          f"{ratios['throughput_mini_vs_train']:.3f}  L={mb['lookahead_groups']}  quota violations "
          f"{metrics['quota_violations']}  plan p50 {plan_ms:.1f} ms  wall {wall[0]:.0f}s")
    return doc


def _plot(path: Path, res: dict[str, dict[str, Any]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plotting is optional
        log.warning("matplotlib not installed (pip install knittrans[bench]); no plot written")
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    for pol, r in res.items():
        label = f"{pol} (L={r['lookahead_groups']})"
        ax.plot(range(len(r["per_step_arch_mean"])), r["per_step_arch_mean"], label=label, marker=".")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean architectural staleness (versions)")
    ax.set_title("Architectural staleness per optimizer step (seed 0)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
