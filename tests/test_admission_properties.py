"""Property tests (hypothesis) of the guarantees listed in the ``admission.planner`` module docstring.

A random workload of prompt groups is dispatched through a window, completes in random order, and
the planner runs after every completion; each guarantee is checked against an independent brute
force over quota classes (tiny batches, so exhaustive enumeration is cheap).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, replace

import polars as pl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

from admission import AdmissionConfig, Filters, LinkModel, Planner, Quota
from schemas.plan import MiniBatchPlan

SOURCES = ("a", "b")
LEVELS = ("x", "y")


@dataclass
class Scenario:
    config: AdmissionConfig
    classes: list[tuple[str, str]]  # (data_source, level) per group
    lengths: list[list[int]]  # response lengths per group
    rewards: list[list[float]]
    aborted: list[bool]
    order: list[int]  # completion order among dispatched (indices into a pool)
    window: int


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    k = draw(st.sampled_from([1, 2]))
    m = draw(st.integers(1, 3))
    b = k * m
    d = draw(st.integers(1, m))
    g = draw(st.integers(1, 3))
    two = draw(st.booleans())
    ca = draw(st.integers(0, b))
    quotas = [Quota(column="data_source", counts={"a": ca, "b": b - ca})]
    if two:
        cx = draw(st.integers(0, b))
        quotas.append(Quota(column="level", counts={"x": cx, "y": b - cx}))
    cfg = AdmissionConfig(
        train_batch_groups=b, group_size=g, mini_batches=k, dp_ranks=d,
        token_budget=draw(st.integers(60, 600)), cost_model=draw(st.sampled_from(["tokens", "sq_tokens"])),
        quotas=tuple(quotas), policy=draw(st.sampled_from(["mini_batch", "train_batch", "colocated"])),
        max_staleness=draw(st.one_of(st.none(), st.integers(0, 3))),
        filters=Filters(drop_uniform_reward=draw(st.booleans())),
        assignment=draw(st.sampled_from(["links", "tokens"])),
        links=LinkModel(node_host={"n0": "h0", "n1": draw(st.sampled_from(["h0", "h1"]))},
                        rank_host=tuple(draw(st.sampled_from(["h0", "h1", "h2"])) for _ in range(d))),
    )
    n = draw(st.integers(b, 4 * b + 2))
    classes = [(draw(st.sampled_from(SOURCES)), draw(st.sampled_from(LEVELS))) for _ in range(n)]
    lengths = [[draw(st.integers(1, 400)) for _ in range(g)] for _ in range(n)]
    rewards = [[float(draw(st.integers(0, 1))) for _ in range(g)] for _ in range(n)]
    aborted = [draw(st.integers(0, 9)) == 0 for _ in range(n)]
    order = draw(st.permutations(range(n)))
    window = draw(st.integers(1, n))
    return Scenario(cfg, classes, lengths, rewards, aborted, list(order), window)


def _frame(rows: list[dict[str, object]]) -> pl.DataFrame:
    schema = {"seq": pl.Int64, "node": pl.String, "group_id": pl.String, "sample_idx": pl.Int32,
              "policy_version": pl.Int64, "policy_version_min": pl.Int64, "data_source": pl.String,
              "level": pl.String, "prompt_len": pl.Int32, "response_len": pl.Int32, "reward": pl.Float32,
              "finish_reason": pl.String, "status": pl.String}
    return pl.DataFrame(rows, schema=schema)


def _class_sat(avail: dict[tuple[str, str], int], supply: dict[tuple[str, str], int], cfg: AdmissionConfig,
               need: list[dict[str, int]], total: int, size: int) -> bool:
    """Brute force: is there x <= avail, x <= z <= avail + supply, sum x = size, z meeting need?"""
    keys = sorted(set(avail) | set(supply))
    cols = cfg.quota_columns
    ranges = [range(min(avail.get(c, 0) + supply.get(c, 0), total) + 1) for c in keys]
    for z in itertools.product(*ranges):
        if sum(z) != total:
            continue
        ok = True
        for qi, col in enumerate(cols):
            idx = 0 if col == "data_source" else 1
            for v, nv in need[qi].items():
                if sum(zc for zc, key in zip(z, keys, strict=True) if key[idx] == v) != nv:
                    ok = False
        if ok and sum(min(zc, avail.get(key, 0)) for zc, key in zip(z, keys, strict=True)) >= size:
            return True
    return False


def _check_plan_shape(p: MiniBatchPlan, cfg: AdmissionConfig, lengths: dict[str, list[int]]) -> None:
    counts = {len(r.micro_batches) for r in p.ranks}
    assert len(counts) == 1, counts  # guarantee 6
    assert len(p.ranks) == cfg.dp_ranks
    seen: Counter[tuple[str, int]] = Counter()
    group_rank: dict[str, int] = {}
    for r in p.ranks:
        for mb in r.micro_batches:
            toks = 0
            for s in mb.slices:
                for i in range(s.start, s.stop):
                    seen[(s.group_id, i)] += 1
                    toks += 10 + lengths[s.group_id][i]
                assert group_rank.setdefault(s.group_id, r.dp_rank) == r.dp_rank
            assert mb.tokens == toks
            assert len(mb.advantages) == mb.rows
            if mb.oversized:  # guarantee 7
                assert mb.rows == 1 and toks > cfg.token_budget
            else:
                assert toks <= cfg.token_budget
    assert len(p.group_ids) == cfg.groups_per_mini_batch
    for gid in p.group_ids:  # guarantee 2: whole groups, each row exactly once
        for i in range(cfg.group_size):
            assert seen[(gid, i)] == 1
    assert sum(seen.values()) == cfg.groups_per_mini_batch * cfg.group_size


class _Arrivals:
    """The scenario's groups, dispatched through its window and completed in its order."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.versions: dict[int, int] = {}
        self.dispatched: list[int] = []
        self.completed: set[int] = set()
        self.seq = 0
        self._next = 0
        self._order = list(sc.order)

    def done(self) -> bool:
        return len(self.completed) == len(self.sc.classes)

    def complete_next(self, steps: int) -> list[dict[str, object]]:
        """Dispatch up to the window (at policy version ``steps``), complete the next group; its rows."""
        sc, cfg = self.sc, self.sc.config
        while self._next < len(sc.classes) and len(self.dispatched) - len(self.completed) < sc.window:
            self.versions[self._next] = steps
            self.dispatched.append(self._next)
            self._next += 1
        i = next(j for j in self._order if j in self.versions and j not in self.completed)
        self._order.remove(i)
        self.completed.add(i)
        out: list[dict[str, object]] = []
        for s in range(cfg.group_size):
            status = "aborted" if sc.aborted[i] and s == 0 else "completed"
            out.append({"seq": self.seq, "node": f"n{i % 2}", "group_id": f"g{i}", "sample_idx": s,
                        "policy_version": self.versions[i], "policy_version_min": self.versions[i],
                        "data_source": sc.classes[i][0], "level": sc.classes[i][1], "prompt_len": 10,
                        "response_len": sc.lengths[i][s], "reward": sc.rewards[i][s],
                        "finish_reason": "stop", "status": status})
            self.seq += 1
        return out

    def flight(self) -> Counter[tuple[str, str]]:
        """Groups dispatched, not completed, per (data_source, level)."""
        return Counter(self.sc.classes[j] for j in self.dispatched if j not in self.completed)

    def inflight(self) -> dict[object, int]:
        """:meth:`flight` keyed as the planner's ``inflight`` wants it for the scenario's quotas."""
        if len(self.sc.config.quotas) == 2:
            return dict(self.flight())
        merged: Counter[str] = Counter()
        for key, c in self.flight().items():
            merged[key[0]] += c
        return dict(merged)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_planner_guarantees(sc: Scenario) -> None:
    cfg = sc.config
    planner = Planner(cfg)
    n = len(sc.classes)
    arrivals = _Arrivals(sc)
    rows: list[dict[str, object]] = []
    steps = 0
    all_plans: list[MiniBatchPlan] = []
    lengths = {f"g{i}": sc.lengths[i] for i in range(n)}
    while not arrivals.done():
        rows += arrivals.complete_next(steps)
        before = planner.state
        plans = planner.update(_frame(rows), inflight=arrivals.inflight(), current_version=steps)
        steps += len(plans)
        all_plans.extend(plans)
        for p in plans:
            _check_plan_shape(p, cfg, lengths)
        state = planner.state
        # groups still admissible after this call (completed, not admitted, not dropped)
        live = [j for j in arrivals.completed if f"g{j}" not in state.admitted and f"g{j}" not in state.dropped]
        avail = Counter(sc.classes[j] for j in live)
        supply = arrivals.flight()
        used = state.used()
        qc = cfg.quota_counts()
        need = [{v: qc[qi][v] - used.get((q.column, v), 0) for v in qc[qi]} for qi, q in enumerate(cfg.quotas)]
        total = cfg.train_batch_groups - state.position * cfg.groups_per_mini_batch
        if cfg.policy == "mini_batch":
            if plans and state.position > 0:  # guarantee 4: the remainder of this train batch stays satisfiable
                assert _class_sat(dict(avail), dict(supply), cfg, need, total, 0)
            # guarantee 5: nothing more is admissible (staleness drops already applied by the planner)
            assert not _class_sat(dict(avail), dict(supply), cfg, need, total, cfg.groups_per_mini_batch)
        else:
            assert not _class_sat(dict(avail), {}, cfg, need, total, total)
        assert state.admitted >= before.admitted
    consumed = planner.consumed_frame()
    # guarantee 1: each trajectory at most once
    assert consumed.select(pl.struct("group_id", "sample_idx").is_duplicated().any()).item() is False
    ids = [g for p in all_plans for g in p.group_ids]
    assert len(ids) == len(set(ids))
    assert [p.step for p in all_plans] == list(range(len(all_plans)))
    # guarantee 3: completed train batches meet the quotas exactly
    k = cfg.mini_batches
    full = len(all_plans) // k
    for t in range(full):
        sub = consumed.filter(pl.col("train_batch") == t)
        for q, counts in zip(cfg.quotas, cfg.quota_counts(), strict=True):
            got = dict(sub.group_by(q.column).agg(pl.col("group_id").n_unique()).iter_rows())
            assert {v: got.get(v, 0) for v in counts} == counts
            assert set(got) <= set(counts)
    # guarantee 8: staleness bound
    if cfg.max_staleness is not None and consumed.height:
        assert consumed["arch_staleness"].max() <= cfg.max_staleness
    if cfg.policy == "colocated" and consumed.height:
        assert consumed["arch_staleness"].max() == 0
    # dropped groups are never admitted, aborted ones always dropped
    dropped = planner.dropped_frame()
    assert not set(dropped["group_id"].to_list()) & set(ids)
    for i in range(n):
        if sc.aborted[i]:
            assert f"g{i}" not in ids


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_a_planner_that_forgets_settled_groups_plans_the_same(sc: Scenario) -> None:
    """The trainer's bounded use (``train.planning.PlanSource``): each update sees only the rows of groups not
    yet settled, then the planner's frames are drained and the settled ids forgotten. Plans, consumed and dropped
    rows and the state's counters equal those of a planner that sees every row and keeps everything, while the
    bounded planner's state holds no id after each round."""
    cfg = sc.config
    full, bounded = Planner(cfg), Planner(cfg)
    arrivals = _Arrivals(sc)
    rows: list[dict[str, object]] = []
    pending: list[dict[str, object]] = []
    consumed: list[pl.DataFrame] = []
    dropped: list[pl.DataFrame] = []
    steps = 0
    while not arrivals.done():
        new = arrivals.complete_next(steps)
        rows += new
        pending += new
        plans = full.update(_frame(rows), inflight=arrivals.inflight(), current_version=steps)
        assert bounded.update(_frame(pending), inflight=arrivals.inflight(), current_version=steps) == plans
        steps += len(plans)
        c, d = bounded.drain()
        consumed += [c] if c.height else []
        dropped += [d] if d.height else []
        settled = bounded.state.admitted | bounded.state.dropped
        pending = [r for r in pending if r["group_id"] not in settled]
        bounded.forget(settled)
        assert bounded.state == replace(full.state, admitted=frozenset(), dropped=frozenset())
    if consumed:
        assert_frame_equal(pl.concat(consumed, how="diagonal_relaxed"), full.consumed_frame())
    else:
        assert full.consumed_frame().height == 0
    if dropped:
        assert_frame_equal(pl.concat(dropped, how="diagonal_relaxed"), full.dropped_frame())
    else:
        assert full.dropped_frame().height == 0
