"""The discrete-event simulation of a disaggregated RL pipeline, calling the production planner.

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
  max, signed mean; and per train batch, which sets a run's start apart from its steady state);
  quota violations (train batches whose ``data_source`` counts differ from the quota); trainer
  idle fraction and throughput (trajectories per simulated second) measured in steady state, from
  the end of train batch 0 to the end of the run.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import Counter, deque
from typing import Any

import numpy as np
import polars as pl

from admission import Planner, summary
from bench.staleness.workload import SOURCES, SimParams, admission_config, dispatch_order, make_prompts
from connectors.dispatch import LATENCY_WINDOW, RATE_WINDOW, measured_leads

log = logging.getLogger(__name__)


def simulate(p: SimParams, policy: str, lookahead: int, seed: int) -> dict[str, Any]:
    """Run one simulation; returns metrics and the per-step staleness."""
    sim = _Pipeline(p, policy, lookahead, seed)
    sim.run()
    return _results(sim)


class _Pipeline:
    """One simulation's state and events: the loader's cursor, the rollout's slots, the planner, the trainer."""

    def __init__(self, p: SimParams, policy: str, lookahead: int, seed: int) -> None:
        prompts = make_prompts(p, seed, p.train_batches + 3)
        cfg = admission_config(p, policy)
        self.p, self.policy, self.lookahead = p, policy, lookahead
        self.planner = Planner(cfg)
        self.m = cfg.groups_per_mini_batch
        self.unit = self.m if policy in ("mini_batch", "streaming") else p.groups  # the planner's admission unit
        self.total_steps = p.train_batches * p.mini_batches
        self.flat = dispatch_order(prompts, p) if policy != "colocated" else [pr for ch in prompts for pr in ch]
        self.now = 0.0
        self.events: list[tuple[float, int, str, int]] = []
        self.counter = 0
        self.free_slots = p.slots
        self.version = 0  # rollout weights
        self.steps_done = 0
        self.next_prompt = 0  # flat index into the loader
        self.queue: deque[int] = deque()  # dispatched, waiting for slots
        self.started: dict[int, int] = {}  # group -> version
        self.start_time: dict[int, float] = {}
        self.remaining: dict[int, int] = {}  # group -> sequences still generating
        self.dispatched_untrained = 0
        self.completed_rows: dict[int, dict[str, np.ndarray]] = {}  # completed, not admitted
        self.inflight_src: Counter[str] = Counter()
        self.plans: deque[Any] = deque()
        self.trainer_busy_until: float | None = None
        self.busy_intervals: list[tuple[float, float]] = []
        self.step_end: list[float] = []
        self.seq_no = 0
        self.calls = 0
        self.slot_busy: list[tuple[float, float]] = []  # (start, end) of every sequence
        self.latency: dict[str, list[float]] = {src: [] for src in SOURCES}
        self.completions: list[float] = []  # times groups completed
        # dispatch from per-class queues (per_class, lead: the rollout's own) for the policies the rollout feeds;
        # streaming stands for the peers, whose rollout dispatches in the loader's order
        self.by_class = p.dispatch in ("per_class", "lead") and policy not in ("colocated", "streaming")
        self.class_queue: dict[str, deque[int]] = {src: deque() for src in SOURCES}  # by_class: loader order
        for i, pr in enumerate(self.flat):
            self.class_queue[pr.source].append(i)
        self.untrained_src: Counter[str] = Counter()  # by_class: dispatched, not yet trained

    def run(self) -> None:
        """Process events until every train batch is trained (or nothing is left to happen)."""
        self._dispatch()
        self._start_groups()
        while self.events and self.steps_done < self.total_steps:
            self.now, _, kind, x = heapq.heappop(self.events)
            if kind == "seq":
                self._sequence_done(x)
            else:
                self._step_done()

    def _push(self, t: float, kind: str, x: int) -> None:
        self.counter += 1
        heapq.heappush(self.events, (t, self.counter, kind, x))

    def _dispatch(self) -> None:
        """The loader hands prompts to the rollout while the lookahead allows (colocated: a train batch at a time)."""
        b, k_mb = self.p.groups, self.p.mini_batches
        if self.by_class:
            if self.p.dispatch == "lead":
                self._dispatch_lead()
            else:
                self._dispatch_per_class()
            return
        while self.dispatched_untrained < self.lookahead and self.next_prompt < len(self.flat):
            if self.policy == "colocated" and self.steps_done < (self.next_prompt // b) * k_mb:
                break
            self.queue.append(self.next_prompt)
            self.inflight_src[self.flat[self.next_prompt].source] += 1
            self.next_prompt += 1
            self.dispatched_untrained += 1

    def _class_limits(self) -> dict[str, float]:
        """L_s = share_s * L + rate_s * (latency_s - mean latency): every class keeps the same wait for the trainer
        (Little's law), so a slow class gets the lead its generation needs and a fast one none beyond it. Latency
        and the trainer's rate (groups trained per second, last 2K steps) are measured online."""
        share = {src: 1.0 / len(SOURCES) for src in SOURCES}
        k = 2 * self.p.mini_batches
        if len(self.step_end) <= k or not all(self.latency.values()):
            return {src: share[src] * self.lookahead for src in SOURCES}
        rate = k * self.m / (self.step_end[-1] - self.step_end[-1 - k])
        lat = {src: float(np.mean(v[-LATENCY_WINDOW:])) for src, v in self.latency.items()}
        mean = sum(share[src] * lat[src] for src in SOURCES)
        return {src: share[src] * self.lookahead + share[src] * rate * (lat[src] - mean) for src in SOURCES}

    def _leads(self) -> dict[str, float]:
        """Per class, how many places ahead of its loader position a prompt goes out: the rollout worker's rule
        (``connectors.dispatch.measured_leads``) over latencies and a rate measured online: each class's
        ``source_latency`` (the upper quartile of its last 64 groups' latencies and its running groups' ages)
        and the rate of the last 64 completions; 0 until two groups are done."""
        running: dict[str, list[float]] = {}
        for gi, t0 in self.start_time.items():
            running.setdefault(self.flat[gi].source, []).append(self.now - t0)
        windows = {src: v[-LATENCY_WINDOW:] for src, v in self.latency.items()}
        leads = measured_leads(self.completions[-RATE_WINDOW:], windows, running)
        return {src: leads.get(src, 0.0) for src in SOURCES}

    def _dispatch_lead(self) -> None:
        """Dispatch, while L allows, the waiting prompt of the lowest loader position minus its class's lead."""
        leads = self._leads()
        while self.dispatched_untrained < self.lookahead:
            heads = {src: q[0] - leads[src] for src, q in self.class_queue.items() if q}
            if not heads:
                return
            src = min(heads, key=lambda k: heads[k])
            self._send(self.class_queue[src].popleft())

    def _send(self, gi: int) -> None:
        """Hand prompt ``gi`` to the rollout (queued until G slots are free)."""
        src = self.flat[gi].source
        self.queue.append(gi)
        self.inflight_src[src] += 1
        self.untrained_src[src] += 1
        self.dispatched_untrained += 1

    def _dispatch_per_class(self) -> None:
        """Dispatch the class furthest below its L_s (in loader order within the class) while L allows."""
        limits = self._class_limits()
        while self.dispatched_untrained < self.lookahead:
            room = {src: limits[src] - self.untrained_src[src] for src in SOURCES if self.class_queue[src]}
            if not room or max(room.values()) <= 0:
                return
            src = max(room, key=lambda k: room[k])
            self._send(self.class_queue[src].popleft())

    def _future(self) -> Counter[str]:
        """The loader's committed prompts not yet dispatched: up to the end of the next chunk (per class with
        ``per_class`` or ``lead``: each class's prompts of the chunk its next prompt is in, and of the chunk after)."""
        b = self.p.groups
        if not self.by_class:
            horizon = min(len(self.flat), (self.next_prompt // b + 2) * b)
            return Counter(self.flat[i].source for i in range(self.next_prompt, horizon))
        out: Counter[str] = Counter()
        for src, q in self.class_queue.items():
            if q:
                end = (q[0] // b + 2) * b
                out[src] = sum(1 for _ in itertools.takewhile(end.__gt__, q))
        return out

    def _start_groups(self) -> None:
        """Start queued groups while G slots are free; every sequence ends after its own length."""
        g = self.p.group_size
        while self.queue and self.free_slots >= g:
            gi = self.queue.popleft()
            self.free_slots -= g
            self.started[gi] = self.version
            self.start_time[gi] = self.now
            self.remaining[gi] = g
            for length in self.flat[gi].lengths:
                self._push(self.now + float(length) * self.p.gen_s_per_token, "seq", gi)
                self.slot_busy.append((self.now, self.now + float(length) * self.p.gen_s_per_token))

    def _sequence_done(self, x: int) -> None:
        """A sequence of group ``x`` ends: free its slot; the group's last one makes its metadata rows."""
        self.free_slots += 1
        self.remaining[x] -= 1
        if self.remaining[x] == 0:
            del self.remaining[x]
            pr = self.flat[x]
            self.inflight_src[pr.source] -= 1
            v0 = self.started.pop(x)
            self.latency[pr.source].append(self.now - self.start_time.pop(x))
            self.completions.append(self.now)
            v = self.version if self.p.version_at == "complete" else v0
            g = self.p.group_size
            self.seq_no += g
            self.completed_rows[x] = {
                "seq": np.arange(self.seq_no - g, self.seq_no, dtype=np.int64),
                "group_id": np.full(g, str(x)), "sample_idx": np.arange(g, dtype=np.int32),
                "policy_version": np.full(g, v, dtype=np.int64),
                "policy_version_min": np.full(g, v0, dtype=np.int64), "data_source": np.full(g, pr.source),
                "prompt_len": np.full(g, pr.prompt_len, dtype=np.int32),
                "response_len": pr.lengths.astype(np.int32), "reward": pr.rewards,
                "status": np.full(g, "completed"),
            }
            self._call_planner()
        self._start_groups()

    def _step_done(self) -> None:
        """An optimizer step ends: the new weights reach the rollout (per step or per train batch), refill."""
        done = self.plans.popleft()
        for gid in done.group_ids:
            self.untrained_src[self.flat[int(gid)].source] -= 1
        self.trainer_busy_until = None
        self.steps_done += 1
        self.step_end.append(self.now)
        self.dispatched_untrained -= self.m
        if self.p.sync == "per_step" or self.steps_done % self.p.mini_batches == 0:
            self.version = self.steps_done
        self._dispatch()
        self._start_groups()
        self._call_planner()
        self._maybe_train()

    def _call_planner(self) -> None:
        """The planner on the completed, unadmitted rows, with the committed supply as ``inflight``."""
        if len(self.completed_rows) < self.unit:
            return
        self.calls += 1
        cols = list(next(iter(self.completed_rows.values())))
        frame = pl.DataFrame({c: np.concatenate([r[c] for r in self.completed_rows.values()]) for c in cols})
        # committed supply: in flight + the loader's prompts up to the end of the next chunk
        future = self._future()
        inflight = {s: self.inflight_src[s] + future[s] for s in SOURCES}
        new = self.planner.update(frame, inflight=inflight, current_version=self.version)
        for pl_ in new:
            for gid in pl_.group_ids:
                self.completed_rows.pop(int(gid), None)
            self.plans.append(pl_)
        if new:
            self._maybe_train()

    def _maybe_train(self) -> None:
        """Start the next admitted mini-batch when the trainer is idle: tokens of its most loaded rank."""
        if self.trainer_busy_until is not None or not self.plans:
            return
        mb = self.plans[0]
        rank_tokens = max(sum(mbx.tokens for mbx in r.micro_batches) for r in mb.ranks)
        dur = rank_tokens * self.p.train_s_per_token
        self.trainer_busy_until = self.now + dur
        self.busy_intervals.append((self.now, self.now + dur))
        self._push(self.now + dur, "step", mb.step)


def _results(sim: _Pipeline) -> dict[str, Any]:
    """Staleness from the planner's accounting; idle, throughput and latencies in steady state."""
    p, k_mb, step_end = sim.p, sim.p.mini_batches, sim.step_end
    consumed = sim.planner.consumed_frame().filter(pl.col("step") < sim.total_steps)
    rep = sim.planner.staleness_report()
    run = summary(consumed).to_dict()  # same accounting on the trimmed frame
    per_tb = consumed.group_by("train_batch").agg(pl.col("arch_staleness").mean()).sort("train_batch")
    per_train_batch = [float(x) for x in per_tb["arch_staleness"]]
    if len(step_end) <= k_mb:  # the pipeline deadlocked (lookahead held by groups no quota admits)
        log.warning("%s with L=%d deadlocked after %d steps", sim.policy, sim.lookahead, len(step_end))
        return {"arch_mean": run["arch_mean"], "arch_token_weighted": run["arch_token_weighted"],
                "arch_max": run["arch_max"], "signed_mean": run["signed_mean"],
                "generation_span_mean": run["span_mean"], "generation_span_token_weighted": run["span_token_weighted"],
                "total_staleness_mean": run["total_mean"],
                "total_staleness_token_weighted": run["total_token_weighted"], "quota_violations": 0,
                "trainer_idle_fraction": 1.0, "throughput": 0.0, "rollout_slot_utilization": 0.0,
                "step_s_mean": float("nan"), "math_group_latency_s_mean": float("nan"),
                "chat_group_latency_s_mean": float("nan"), "sim_seconds": sim.now, "planner_calls": sim.calls,
                "per_step_arch_mean": [r["arch_mean"] for r in rep["per_step"]],
                "per_train_batch_arch_mean": per_train_batch}
    t0, t1 = step_end[k_mb - 1], step_end[-1]
    busy = sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in sim.busy_intervals)
    trained = (len(step_end) - k_mb) * sim.m * p.group_size
    slot_s = sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in sim.slot_busy)
    return {
        "arch_mean": run["arch_mean"], "arch_token_weighted": run["arch_token_weighted"],
        "arch_max": run["arch_max"], "signed_mean": run["signed_mean"],
        "generation_span_mean": run["span_mean"], "generation_span_token_weighted": run["span_token_weighted"],
        "total_staleness_mean": run["total_mean"], "total_staleness_token_weighted": run["total_token_weighted"],
        "quota_violations": _quota_violations(consumed, p), "trainer_idle_fraction": 1.0 - busy / (t1 - t0),
        "throughput": trained / (t1 - t0),
        "rollout_slot_utilization": slot_s / (p.slots * (t1 - t0)),
        "step_s_mean": (t1 - t0) / (len(step_end) - k_mb),
        "math_group_latency_s_mean": float(np.mean(sim.latency["math"])),
        "chat_group_latency_s_mean": float(np.mean(sim.latency["chat"])), "sim_seconds": t1,
        "planner_calls": sim.calls,
        "per_step_arch_mean": [r["arch_mean"] for r in rep["per_step"] if r["step"] < sim.total_steps],
        "per_train_batch_arch_mean": per_train_batch,
    }


def _quota_violations(consumed: pl.DataFrame, p: SimParams) -> int:
    """Train batches whose ``data_source`` counts (distinct groups) differ from the 50/50 quota, per source."""
    viol = 0
    for t in range(p.train_batches):
        sub = consumed.filter(pl.col("train_batch") == t)
        cnt = dict(sub.group_by("data_source").agg(pl.col("group_id").n_unique()).iter_rows())
        viol += sum(1 for s in SOURCES if cnt.get(s, 0) != p.groups // 2)
    return viol
