"""Groups in flight: registered with their node at dispatch, resolved by their rows or explicitly, read as supply."""

from __future__ import annotations

import json
from typing import Any

import pytest

from flight_store.errors import WireDecodeError, WrongNodeError
from flight_store.publishing import StorePublisher
from flight_store.reading import StoreReader
from flight_store.writing import StoreWriter
from schemas.replies import ACTION_REPLIES, DispatchReply
from schemas.wire import DispatchedGroup


def _d(gid: str, source: str = "math", state: str = "running", version: int = 0) -> DispatchedGroup:
    return DispatchedGroup(group_id=gid, data_source=source, prompt_id=gid, dispatch_version=version,
                           state=state)  # type: ignore[arg-type]


def test_dispatched_groups_are_in_flight_on_their_node_until_written(store_nodes, make_group,  # type: ignore[no-untyped-def]
                                                                    spread_ids) -> None:
    servers = store_nodes(2)
    with StoreReader([s.location for s in servers]) as client, StoreWriter.sharing(client) as writer:
        ids = spread_ids(client, 6)
        assert writer.dispatch([_d(g, "math" if i % 2 else "code") for i, g in enumerate(ids)]) == []
        seen = client.inflight()
        assert sorted(seen.groups["group_id"].to_list()) == sorted(ids)
        assert dict(zip(seen.groups["group_id"], seen.groups["node"], strict=True)) == {g: client.node_for(g)
                                                                                        for g in ids}
        assert seen.registered_total == 6
        assert seen.groups.group_by("data_source").len().sort("data_source").rows() == [("code", 3), ("math", 3)]

        writer.dispatch([_d(ids[0], state="queued", version=3)])  # an update, not a second registration
        row = client.inflight().groups.filter(group_id=ids[0]).row(0, named=True)
        assert (row["state"], row["dispatch_version"]) == ("queued", 3)

        writer.put_group(make_group(ids[1], size=2))  # its rows resolve it
        assert writer.resolve([ids[2], "never-dispatched"], "aborted") == 1
        after = client.inflight()
        assert sorted(after.groups["group_id"].to_list()) == sorted(set(ids) - {ids[1], ids[2]})
        assert after.registered_total == 6 and after.resolved == {"written": 1, "aborted": 1}
        assert sum(st.groups.inflight for st in client.stats().values()) == 4

        # a registration that arrives after the group's rows changes nothing
        assert writer.dispatch([_d(ids[1])]) == [ids[1]]
        assert ids[1] not in client.inflight().groups["group_id"].to_list()


def test_a_group_is_registered_only_with_its_own_node(store_nodes) -> None:  # type: ignore[no-untyped-def]
    from flight_store.config import ClusterMember, ServerConfig
    from flight_store.net import free_port

    ports = [free_port() for _ in range(2)]
    members = [ClusterMember(id=f"node{i}", location=f"grpc://127.0.0.1:{p}") for i, p in enumerate(ports)]
    servers = [store_nodes(1, ServerConfig(port=p, node_name=f"node{i}", cluster=members))[0]
               for i, p in enumerate(ports)]
    with StoreReader.from_cluster(servers[0].location) as client, StoreWriter.sharing(client) as writer:
        gid = "g0"
        other = next(s for s in servers if s.location != client.node_for(gid))
        body = json.dumps({"v": 3, "groups": [_d(gid).model_dump()]}).encode()
        with pytest.raises(WrongNodeError, match="belongs to node"):
            client._calls.action(other.location, "dispatch", DispatchReply, body)
        assert client.inflight().groups.height == 0
        writer.dispatch([_d(gid)])  # the client sends it where it belongs
        assert client.inflight().groups["node"].to_list() == [client.node_for(gid)]


@pytest.mark.parametrize("doc, what", [
    ({"v": 3, "groups": []}, "groups"),
    ({"v": 3, "groups": [{"group_id": "g", "data_source": "m", "prompt_id": "g", "dispatch_version": 0,
                          "state": "done"}]}, "state"),
    ({"v": 3, "groups": [{"group_id": "g", "data_source": "", "prompt_id": "g", "dispatch_version": 0}]},
     "data_source"),
    ({"v": 3, "group_ids": ["g"], "reason": "lost"}, "reason"),
])
def test_bad_bodies_are_refused_by_name(store_nodes, doc, what) -> None:  # type: ignore[no-untyped-def]
    (server,) = store_nodes(1)
    action = "resolve" if "reason" in doc else "dispatch"
    with StoreReader(server.location) as client:
        with pytest.raises(WireDecodeError, match=what):
            client._calls.action(server.location, action, ACTION_REPLIES[action], json.dumps(doc).encode())
        assert client.inflight().registered_total == 0


def test_groups_the_engine_aborts_go_out_again_and_every_train_batch_keeps_its_quota(  # type: ignore[no-untyped-def]
        store_nodes, tmp_path) -> None:
    """The engine loses every 3rd request mid-run; each lost prompt is dispatched again, the planner (fed the
    stores' in-flight groups) fills every train batch with exactly its quota, and every prompt is trained once."""
    import random
    import threading
    import time

    import polars as pl

    from admission.config import AdmissionConfig, Quota
    from admission.planner import Planner
    from connectors.config import RolloutConfig
    from connectors.fake_engine import FakeEngine
    from connectors.rollout import RolloutWorker
    from connectors.tasks import ARITHMETIC_TASKS
    from train.planning import ConsumedLog, PlanSource

    b, g, k, batches = 4, 4, 2, 6
    rng = random.Random(3)
    prompts = [ARITHMETIC_TASKS[s].make(rng) for s in ["add_small", "mul_large"] * (b * batches // 2)]
    rng.shuffle(prompts)  # the loader's order: each class half of the prompts, not half of every train batch
    servers = store_nodes(2)
    locations = [s.location for s in servers]
    engine = FakeEngine(max_steps=3, abort_every=3)
    cfg = RolloutConfig(model="unused", stores=locations, group_size=g, max_groups=0, prompts_per_wave=4,
                        version_poll_s=0.0, group_id_prefix="t-", max_unreleased_groups=b + b // k,
                        lookahead_counts_running=True, lookahead_poll_s=0.02, commit_ahead=b, max_redispatch=20)
    admission = AdmissionConfig(train_batch_groups=b, group_size=g, mini_batches=k,
                                quotas=(Quota(column="data_source", counts={"add_small": 2, "mul_large": 2}),))
    with StoreReader(locations) as client, StoreWriter.sharing(client) as writer:
        worker = RolloutWorker(cfg, client=writer, engine=engine, prompts=iter(prompts))
        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.setdefault("report", worker.run()), daemon=True)
        thread.start()
        path = tmp_path / "consumed.parquet"
        with ConsumedLog(str(path)) as log:
            source = PlanSource(client, Planner(admission), supply_from_stores=True, consumed_log=log)
            deadline = time.monotonic() + 60
            while source.admitted_groups < b * batches and time.monotonic() < deadline:
                for plan in source.poll(current_version=0, waiting=True):  # a trainer that consumes at once
                    client.release(plan.group_ids)
                time.sleep(0.01)
        worker.stop()  # it ends by itself once every prompt went out; a failed run must not hang the test
        thread.join(timeout=10)
        assert not thread.is_alive()
        left = client.inflight()
    report = result["report"]
    consumed = pl.read_parquet(path)
    assert len(engine.killed) >= 8 and report.redispatched  # groups were lost mid-run and went out again
    assert source.exact_updates > 0
    per_class = consumed.group_by(["train_batch", "data_source"]).agg(pl.col("group_id").n_unique().alias("n"))
    assert per_class.height == 2 * batches and set(per_class["n"].to_list()) == {2}, per_class  # every quota met
    # every prompt trained exactly once, whichever attempt reached the trainer; lost attempts never trained
    prompt_of = {gid: report.redispatched.get(gid, gid) for gid in consumed["group_id"].unique().to_list()}
    assert len(prompt_of) == len(set(prompt_of.values())) == b * batches
    assert not set(engine.killed) & set(prompt_of)
    assert set(prompt_of) & set(report.redispatched), "no re-dispatched prompt was trained"
    assert left.groups.height == 0 and left.resolved["written"] == b * batches + len(engine.killed)


def test_the_demand_stands_only_while_the_trainer_waits_for_data(store_nodes, make_group) -> None:  # type: ignore[no-untyped-def]
    """The planner tells the rollout which class its train batch lacks only while the trainer has no plan left;
    a demand left standing while it trains queued plans let the rollout run past its lookahead limit."""
    from admission.config import AdmissionConfig, Quota
    from admission.planner import Planner
    from train.planning import PlanSource

    (server,) = store_nodes(1)
    admission = AdmissionConfig(train_batch_groups=2, group_size=2,
                                quotas=(Quota(column="data_source", counts={"math": 1, "code": 1}),))
    with StoreReader(server.location) as client, StoreWriter.sharing(client) as writer:
        def demand() -> dict[str, int]:
            return dict(next(iter(client.stats().values())).demand)

        writer.dispatch([_d("q0", "math", state="queued")])  # a rollout registers its groups
        writer.put_group(make_group("m0", size=2, data_source="math"))
        source = PlanSource(client, Planner(admission), supply_from_stores=True)
        assert source.poll(0) == [] and demand() == {}  # plans still queued: the trainer lacks nothing yet
        assert source.poll(0, waiting=True) == [] and demand() == {"code": 1}  # waiting: the class it lacks
        assert source.poll(0) == [] and demand() == {}  # withdrawn as soon as the trainer has work again
        assert source.poll(0, waiting=True) == [] and demand() == {"code": 1}
        writer.dispatch([_d("c0", "code")])
        assert source.poll(0, waiting=True) == [] and demand() == {}  # a running group will bring it
        writer.put_group(make_group("c0", size=2, data_source="code"))
        (plan,) = source.poll(0, waiting=True)
        assert sorted(plan.group_ids) == ["c0", "m0"] and demand() == {}


def test_committed_prompts_go_out_slow_source_ahead_by_its_lead(store_nodes) -> None:  # type: ignore[no-untyped-def]
    """With prompts committed ahead, a slow source's prompt goes out ahead of its place in the stream by its lead
    (``slow_ahead``: completion rate x latency gap), or first whatever the distance (``slow_first``)."""
    import dataclasses
    import itertools
    from datetime import UTC, datetime, timedelta

    from connectors.config import RolloutConfig
    from connectors.dispatch import DispatchQueue, Drawn, source_latency
    from connectors.fake_engine import FakeEngine
    from connectors.rollout import RolloutWorker, _Pending, _running_ages
    from connectors.tasks import mixed_prompts

    (server,) = store_nodes(1)

    def measured(queue: DispatchQueue, latency: dict[str, float], completions_per_s: float) -> None:
        """``queue`` has seen 11 groups complete at ``completions_per_s``, each source's ``latency`` seconds after
        its dispatch (the sources in turn)."""
        sources = list(latency)
        for i in range(11):
            queue.note_completed(sources[i % len(sources)], latency[sources[i % len(sources)]], i / completions_per_s)

    def order(dispatch_order: str, latency: dict[str, float], completions_per_s: float) -> list[tuple[str, int]]:
        cfg = RolloutConfig(model="unused", stores=[server.location], group_size=2, max_groups=0,
                            prompts_per_wave=1, commit_ahead=8, mix_chunk=8, version_poll_s=0.0,
                            dispatch_order=dispatch_order)
        with StoreReader(server.location) as client, StoreWriter.sharing(client) as writer, RolloutWorker(
                cfg, client=writer, engine=FakeEngine(max_steps=1),
                prompts=itertools.islice(mixed_prompts(cfg.data_sources, seed=5, chunk=8), 8)) as worker:
            worker._top_up()
            queue = worker._committed
            measured(queue, latency, completions_per_s)
            # a fast source's prompt from late in the stream, aborted: no order but this rule sends it first
            late_fast = next(d for d in reversed(list(queue)) if d.prompt.data_source == "add_small")
            queue.put_first(dataclasses.replace(late_fast, group_id="again", attempt=1))
            assert queue.take_next(lambda d: True, dict).group_id == "again"  # an aborted group's prompt first
            out = [queue.take_next(lambda d: True, dict) for _ in range(8)]
            worker._writer.flush()  # registrations go through the writer's queue, in order with the writes
            queued = client.inflight().groups
            assert queued.height == 8 and set(queued["state"]) == {"queued"}  # registered when drawn
        return [(d.prompt.data_source, d.index) for d in out if d is not None]

    slow = {"add_small": 0.1, "mul_large": 2.0}
    first = order("slow_first", slow, 10.0)
    stream = sorted(first, key=lambda x: x[1])
    assert [src for src, _ in stream].count("mul_large") == 4 and stream != first
    assert [src for src, _ in first] == ["mul_large"] * 4 + ["add_small"] * 4
    assert order("slow_ahead", slow, 10.0) == first  # a lead of 19 places: every slow prompt of the 8 first
    assert order("slow_ahead", {"add_small": 0.5, "mul_large": 0.5}, 10.0) == stream  # no gap: the stream's order
    near = order("slow_ahead", slow, 1.0)  # a lead of 1.9 places
    assert near == sorted(stream, key=lambda x: (x[1] - (1.9 if x[0] == "mul_large" else 0.0), x[1]))
    assert near not in (first, stream)
    assert order("loader", slow, 10.0) == stream
    # a source's latency is the upper quartile of its last groups': its tail counts, one outlier does not
    assert source_latency([1.0, 2.0, 3.0, 4.0, 5.0]) == 4.0
    assert source_latency([1.0] * 63 + [100.0]) == 1.0 and source_latency([1.0] * 32 + [9.0] * 32) == 9.0
    # the ages of its groups still running count as well: before any completes, they alone give its lead
    assert source_latency([1.0] * 3, running=[9.0]) == 3.0 and source_latency([], running=[2.0, 4.0]) == 3.5
    queue = DispatchQueue("slow_ahead")
    measured(queue, {"add_small": 0.1}, 10.0)  # 10 groups a second
    prompt = next(p for p in mixed_prompts({"mul_large": 1.0}, seed=5))
    started = datetime.now(UTC) - timedelta(seconds=2.1)
    drawn = Drawn(group_id="g", node=server.location, prompt=prompt, prompt_id="g")
    leads = queue.leads(_running_ages({"g": _Pending(drawn=drawn, image_keys=[], created_at=started, version_min=0)}))
    assert leads["add_small"] == 0.0 and 20.0 <= leads["mul_large"] <= 21.0  # 10/s x (>= 2.1 s - 0.1 s)


def test_a_synchronous_rollout_generates_each_train_batch_with_the_weights_it_starts_from(  # type: ignore[no-untyped-def]
        store_nodes) -> None:
    """``synchronous=(B, K)`` (knit run's colocated policy): train batch t's prompts go out only once the
    engine holds version t*K, so every group of it is generated start to end by those weights."""
    import threading
    import time

    import polars as pl

    from connectors.config import RolloutConfig
    from connectors.fake_engine import FakeEngine
    from connectors.rollout import RolloutWorker

    b, k = 2, 2
    (server,) = store_nodes(1)
    cfg = RolloutConfig(model="unused", stores=[server.location], group_size=2, max_groups=3 * b,
                        prompts_per_wave=4, commit_ahead=b, version_poll_s=0.0, group_id_prefix="s-",
                        synchronous=(b, k))
    with StoreReader(server.location) as client, StoreWriter.sharing(client) as writer, \
            StorePublisher.sharing(client) as publisher:
        worker = RolloutWorker(cfg, client=writer, engine=FakeEngine(max_steps=1))
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()

        def stored_after(wait_s: float) -> int:
            time.sleep(wait_s)
            return int(client.stats()[server.location].groups.stored)

        assert stored_after(0.5) == b  # train batch 1 waits for version 2
        publisher.publish_version(1)
        assert stored_after(0.5) == b  # not yet: its train batch starts from version 2
        publisher.publish_version(2)
        assert stored_after(0.5) == 2 * b
        publisher.publish_version(4)
        thread.join(timeout=10)
        assert not thread.is_alive()
        meta = client.scan_metadata().sort("seq")
    per_group = meta.group_by("group_id", maintain_order=True).agg(
        first=pl.col("policy_version_min").min(), last=pl.col("policy_version").max())
    assert per_group["first"].to_list() == per_group["last"].to_list() == [0, 0, 2, 2, 4, 4]
