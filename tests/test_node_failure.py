"""Node failure: partial metadata scans name the failed node, fetches retry then name node and groups,
and a run (writer + real admission.Planner + fetches) goes on after one of three nodes stops."""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

import pyarrow.flight as flight
import pytest

from admission import AdmissionConfig, Planner
from flight_store.client import StoreAdmin
from flight_store.config import ClusterMember, ServerConfig
from flight_store.errors import NodeUnavailableError, WireDecodeError
from flight_store.net import free_port
from flight_store.publishing import StorePublisher
from flight_store.reading import StoreReader
from flight_store.writing import StoreWriter
from schemas.plan import PlannedSlice
from schemas.wire import DispatchedGroup


def test_partial_scan_and_fetch_retries_name_the_failed_node(store_nodes, make_group, caplog) -> None:  # type: ignore[no-untyped-def]
    servers = store_nodes(3)
    locs = [s.location for s in servers]
    with StoreReader(locs, retries=2, backoff=0.05, timeout=5) as client, StoreWriter.sharing(client) as writer:
        for i, loc in enumerate(locs):
            writer.put_group(make_group(f"g{i}", size=4), node=loc)
            writer.put_group(make_group(f"h{i}", size=4), node=loc)
        servers[1].shutdown()
        dead = locs[1]
        with pytest.raises(NodeUnavailableError, match=dead.replace(".", r"\.")) as strict:
            client.scan_metadata()
        assert strict.value.node == dead
        frame = client.scan_metadata(partial=True)
        assert client.last_failed_nodes == [dead]
        assert sorted(frame["group_id"].unique().to_list()) == ["g0", "g2", "h0", "h2"]
        assert set(frame["node"].to_list()) == {locs[0], locs[2]}
        # scan_new skips the dead node and keeps its cursor
        assert client.scan_new(partial=True).height == 16 and client.last_failed_nodes == [dead]
        # a fetch touching the dead node retries with backoff, then names the node and its groups
        caplog.set_level(logging.WARNING, logger="flight_store")
        caplog.clear()
        wanted = [PlannedSlice(node=locs[0], group_id="g0", start=0, stop=4),
                  PlannedSlice(node=dead, group_id="g1", start=0, stop=2),
                  PlannedSlice(node=dead, group_id="h1", start=1, stop=3)]
        with pytest.raises(NodeUnavailableError, match="g1, h1") as failed:
            client.fetch(wanted)
        retried = [r for r in caplog.records if r.getMessage().startswith(f"call to {dead} failed")]
        assert len(retried) == 2  # retries=2: two backoffs, then the error
        assert failed.value.node == dead and failed.value.group_ids == ["g1", "h1"]
        assert "after 3 attempt(s)" in str(failed.value)
        # live nodes still serve
        assert client.fetch([wanted[0], PlannedSlice(node=locs[2], group_id="h2", start=0, stop=4)]).num_rows == 8
        # once every node answers again, the strict scan works (a fresh node on a new port stands in)
    with StoreReader([locs[0], locs[2]]) as client:
        assert client.scan_metadata().height == 16 and client.last_failed_nodes == []


def test_run_goes_on_when_one_of_three_nodes_stops(store_nodes, make_group) -> None:
    servers = store_nodes(3)
    locs = [s.location for s in servers]
    dead = locs[1]
    alive = set(locs)
    stop = threading.Event()
    written: list[str] = []
    errors: list[str] = []

    def writer() -> None:
        with StoreWriter(locs, timeout=5, retries=0) as w:
            i = 0
            while not stop.is_set() and i < 400:
                gid = f"g{i}"
                i += 1
                target = w.node_for(gid)
                if target not in alive:  # a rollout engine routes around a node that is down
                    target = sorted(alive)[i % len(alive)]
                try:
                    w.put_group(make_group(gid, size=4), node=target)
                except flight.FlightError as exc:  # the write raced with the node going down
                    errors.append(f"{target}: {type(exc).__name__}")
                    continue
                written.append(gid)
                time.sleep(0.002)

    cfg = AdmissionConfig(train_batch_groups=4, group_size=4, mini_batches=2, dp_ranks=2)
    planner = Planner(cfg)
    plans_before: list[set[str]] = []
    plans_after: list[set[str]] = []
    fetched_rows = 0
    consumed: list[str] = []
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        with StoreReader(locs, timeout=5, retries=2, backoff=0.05) as client:
            deadline = time.monotonic() + 60
            while len(plans_after) < 12 and time.monotonic() < deadline:
                if len(plans_before) >= 6 and dead in alive:
                    servers[1].shutdown()  # the node goes away mid-run
                    alive.discard(dead)
                frame = client.scan_metadata(partial=True)
                if dead not in alive:
                    assert client.last_failed_nodes == [dead]
                    assert dead not in set(frame["node"].to_list())
                for p in planner.update(frame):
                    slices = [s for r in p.ranks for mb in r.micro_batches for s in mb.slices]
                    nodes = {s.node for s in slices}
                    (plans_after if dead not in alive else plans_before).append(nodes)
                    table = client.fetch(slices, columns=["group_id", "sample_idx"])
                    assert table.num_rows == sum(s.rows for s in slices) == 8
                    fetched_rows += table.num_rows
                    consumed.extend(p.group_ids)
                    freed = client.release(p.group_ids, partial=True)
                    assert sum(freed.values()) == len(p.group_ids)
                time.sleep(0.01)
    finally:
        stop.set()
        thread.join(timeout=30)
    diag = (len(plans_before), len(plans_after), len(written), errors[:5], thread.is_alive())
    assert len(plans_before) >= 6 and len(plans_after) >= 12, diag
    assert all(e.startswith(dead) for e in errors), diag  # only writes to the dead node failed
    assert any(dead in n for n in plans_before)  # the dead node did serve before it stopped
    assert all(dead not in n for n in plans_after)  # later plans only reference live nodes
    assert len(consumed) == len(set(consumed))  # each group consumed once
    assert fetched_rows == 8 * (len(plans_before) + len(plans_after))



def _cluster(n: int) -> list[ServerConfig]:
    ports = [free_port() for _ in range(n)]
    members = [ClusterMember(id=f"node{i}", location=f"grpc://127.0.0.1:{p}") for i, p in enumerate(ports)]
    return [ServerConfig(port=p, node_name=f"node{i}", cluster=members) for i, p in enumerate(ports)]


def test_a_node_marked_down_moves_its_groups_to_the_nodes_alive_and_back(store_nodes) -> None:  # type: ignore[no-untyped-def]
    from schemas.records import TrajectoryRecord, records_to_batch

    def group(gid: str) -> Any:
        return records_to_batch([TrajectoryRecord(group_id=gid, sample_idx=i, policy_version=0, prompt_ids=[1],
                                                  response_ids=[2], response_logprobs=[-1.0]) for i in range(2)])

    configs = _cluster(3)
    servers = [store_nodes(1, c)[0] for c in configs]
    locs = [s.location for s in servers]
    lost = locs[1]
    with StoreWriter(locs, timeout=5, retries=20, backoff=0.05) as writer, StoreReader.sharing(writer) as reader, \
            StoreAdmin(locs) as admin, \
            StorePublisher.sharing(writer) as publisher:
        theirs = [g for g in (f"g{i}" for i in range(60)) if writer.node_for(g) == lost][:6]
        assert writer.put_group(group(theirs[0])) == lost and writer.cluster_view().version == 1
        servers[1].shutdown()  # lost: nobody has said so yet, so a routed write retries it ...
        put: dict[str, str] = {}
        thread = threading.Thread(target=lambda: put.update(node=writer.put_group(group(theirs[1]))))
        t0 = time.monotonic()
        thread.start()
        time.sleep(0.5)
        assert thread.is_alive() and not put
        told = admin.set_cluster(2, down=["node1"])  # ... until the launcher marks it down
        assert set(told) == {locs[0], locs[2]} and all(v.version == 2 and v.down == ["node1"] for v in told.values())
        thread.join(timeout=20)
        rerouted_s = time.monotonic() - t0 - 0.5
        assert put["node"] in (locs[0], locs[2]) and writer.cluster_view().version == 2
        assert writer.down_nodes == {lost}
        result = writer.put_groups([group(g) for g in theirs[2:4]])
        assert not result.refused and set(result.stored.values()) <= {locs[0], locs[2]}
        assert writer.dispatch([DispatchedGroup(group_id=theirs[4], data_source="s", prompt_id="p4",
                                                dispatch_version=0)]) == []
        # readers leave the lost node out: strict calls answer at once without it
        assert set(reader.scan_new(columns=["group_id"])["group_id"]) == set(theirs[1:4])
        publisher.publish_version(1)
        assert reader.get_version() == 1 and set(reader.stats()) == {locs[0], locs[2]}
        assert reader.inflight().groups["group_id"].to_list() == [theirs[4]]
        # a view not newer changes nothing; an unknown id is refused, named
        assert all(v.version == 2 for v in admin.set_cluster(2, down=[]).values())
        with pytest.raises(WireDecodeError, match=r"\['node9'\] are not members"):
            admin.set_cluster(5, down=["node9"])

        servers[1] = store_nodes(1, configs[1])[0]  # back on its port (here: empty; a spill log would refill it)
        stale = StoreWriter.sharing(writer)  # still routes by view 2
        admin.set_cluster(3)
        assert stale.put_group(group(theirs[5])) == lost  # refused by the node it chose, routed again to node1
        assert writer.cluster_view().version == 3 and writer.down_nodes == frozenset()
        stale.close()
    print(f"\nre-routed a write {rerouted_s:.2f} s after the node was marked down")


def test_routing_keeps_the_last_view_while_no_node_answers(store_nodes, caplog) -> None:  # type: ignore[no-untyped-def]
    """A node down and the other not answering at that moment (cut off, slow, restarting): the view asked last
    routes on, and routing asks again once a node answers; a strict call every node of which is left out raises."""
    configs = _cluster(2)
    servers = [store_nodes(1, c)[0] for c in configs]
    locs = [s.location for s in servers]
    with StoreWriter(locs, timeout=5, retries=2, backoff=0.05) as writer, StoreAdmin(locs) as admin:
        admin.set_cluster(2, down=["node1"])
        assert writer.cluster_view(refresh=True).version == 2 and writer.down_nodes == {locs[1]}
        for s in servers:
            s.shutdown()
        with caplog.at_level(logging.WARNING, logger="flight_store.client"):
            view = writer.cluster_view(refresh=True)
        assert view.version == 2 and "routing on by view v2" in caplog.text
        assert {writer.node_for(f"g{i}") for i in range(20)} == {locs[0]} and writer.down_nodes == {locs[1]}
        servers[0] = store_nodes(1, configs[0])[0]  # back on its port, knowing only its first view
        for _ in range(50):  # the client's connection may wait out gRPC's reconnect backoff first
            if writer.cluster_view(refresh=True).version == 1:
                break
            time.sleep(0.1)
        assert writer.cluster_view().version == 1 and writer.down_nodes == frozenset()
        # a strict call whose every node is left out has no answer to give: it raises, it does not answer nothing
        admin.set_cluster(3, down=["node0", "node1"])
        assert writer.cluster_view(refresh=True).down == set(locs)
        with pytest.raises(NodeUnavailableError, match=re.escape(
                f"get_version: no store node answers (down in cluster view v3: {sorted(locs)})")):
            writer.get_version()
        with pytest.raises(NodeUnavailableError, match="stats: no store node answers"):
            writer.stats()


def test_a_group_two_nodes_hold_is_planned_once(store_nodes, make_group) -> None:  # type: ignore[no-untyped-def]
    servers = store_nodes(2)
    locs = [s.location for s in servers]
    with StoreReader(locs) as client, StoreWriter.sharing(client) as writer:
        for gid in ("a", "b"):
            writer.put_group(make_group(gid, size=4), node=locs[0])
        writer.put_group(make_group("a", size=4), node=locs[1])  # a write routed again after its answer was lost
        frame = client.scan_metadata()
        assert frame.filter(frame["group_id"] == "a")["node"].n_unique() == 2
        planner = Planner(AdmissionConfig(train_batch_groups=2, group_size=4, mini_batches=1, dp_ranks=1,
                                          policy="streaming"))
        (plan,) = planner.update(frame)
        assert sorted(plan.group_ids) == ["a", "b"]
        slices = [s for r in plan.ranks for mb in r.micro_batches for s in mb.slices]
        assert client.fetch(slices, columns=["group_id"]).num_rows == 8
        assert planner.update(frame) == []  # the copy is not admitted later either
