"""Node failure: partial metadata scans name the failed node, fetches retry then name node and groups,
and a run (writer + real admission.Planner + fetches) goes on after one of three nodes stops."""

from __future__ import annotations

import logging
import threading
import time

import pyarrow.flight as flight
import pytest

from admission import AdmissionConfig, Planner
from flight_store.errors import NodeUnavailableError
from flight_store.reading import StoreReader
from flight_store.writing import StoreWriter
from schemas.plan import PlannedSlice


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

