"""A store node lost mid-run, without an engine or a trainer: ``launcher.stores`` restarts it from its spill log,
and the rollout side (writes, the lookahead's stats, weight-sync's version polls) waits through the outage.

Real node processes (``python -m flight_store``, started by ``launcher.children``), real SIGKILL by the pid
``children.json`` records; the rollout test runs the real ``RolloutWorker`` with the scripted engine
(``connectors.fake_engine``). The whole loop with vLLM and Megatron is ``tests/test_run_loop.py``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from connectors.config import RolloutConfig
from connectors.fake_engine import FakeEngine
from connectors.lookahead import LookaheadLimit
from connectors.rollout import RolloutWorker
from flight_store.config import ClusterMember, ServerConfig, StoreConfig
from flight_store.errors import NodeUnavailableError
from flight_store.net import free_port
from flight_store.publishing import StorePublisher
from flight_store.reading import StoreReader
from flight_store.writing import StoreWriter
from launcher.children import Children
from launcher.report import policy_summary, table_rows
from launcher.stores import Stores
from schemas.run_summary import StoreOutage


def _configs(out: Path, n: int) -> list[ServerConfig]:
    ports = [free_port() for _ in range(n)]
    cluster = [ClusterMember(id=f"node{i}", location=f"grpc://127.0.0.1:{p}") for i, p in enumerate(ports)]
    return [ServerConfig(port=p, node_name=f"node{i}", log_level="WARNING", cluster=cluster,
                         store=StoreConfig(spill_dir=str(out / "stores" / f"node{i}"))) for i, p in enumerate(ports)]


def _kill(out: Path, name: str) -> int:
    """SIGKILL the child ``name`` by the pid ``children.json`` records (as a user would); returns the pid."""
    pid = next(int(c["pid"]) for c in json.loads((out / "logs" / "children.json").read_text()) if c["name"] == name)
    os.kill(pid, signal.SIGKILL)
    return pid


def _wait_down(stores: Stores, i: int) -> None:
    deadline = time.monotonic() + 10
    while stores.children[i].alive():
        assert time.monotonic() < deadline, "the killed node is still running"
        time.sleep(0.02)


def test_a_killed_node_comes_back_on_its_port_with_every_acknowledged_group(  # type: ignore[no-untyped-def]
        tmp_path: Path, make_group, spread_ids) -> None:
    with Children(tmp_path / "logs") as kids:
        stores = Stores(kids, _configs(tmp_path, 2), tmp_path, max_restarts=1, start_timeout_s=30)
        stores.start()
        assert stores.check() == [] and stores.outages == []
        node0 = stores.locations[0]
        with StoreReader(stores.locations, retries=20, backoff=0.05, timeout=5) as client, \
                StoreWriter.sharing(client) as writer:
            for gid in spread_ids(client, 8):
                writer.put_group(make_group(gid, size=4))
            before = client.scan_new(columns=["group_id", "sample_idx"]).sort("seq")
            held = before.filter(before["node"] == node0)["group_id"].unique().to_list()
            assert held, "routing gave node0 no group"
            client.release([held[0]])
            with StorePublisher.sharing(client) as publisher:
                publisher.publish_version(3)

            killed = _kill(tmp_path, "store0")
            _wait_down(stores, 0)
            assert stores.check() == ["node0"]  # started again at once; not answering yet
            stores.wait_up()
            (outage,) = stores.outages
            assert outage.store == "store0" and outage.node == "node0" and outage.location == node0
            assert outage.exit_code == -signal.SIGKILL and outage.restarts == 1
            assert outage.back_at is not None and outage.back_at > outage.died_at
            assert outage.record().down_s == pytest.approx(outage.back_at - outage.died_at, abs=1e-3)
            index = json.loads((tmp_path / "logs" / "children.json").read_text())
            assert [c["name"] for c in index] == ["store0", "store1"]
            assert index[0]["pid"] == stores.children[0].pid != killed and index[0]["restarts"] == 1

            # every acknowledged row is back under the same seq: a fresh scan equals the one before the kill
            after = client.scan_metadata(columns=["group_id", "sample_idx"]).sort("seq")
            assert after.sort(["node", "seq"]).equals(before.sort(["node", "seq"]))
            # the planner's cursor stays valid: only rows written after the restart are new
            writer.put_group(make_group("late", size=4))
            assert client.scan_new(columns=["group_id"])["group_id"].to_list() == ["late"] * 4
            stats = client.stats()[node0]
            assert stats.groups.released == 1 and stats.policy_version == 3  # a release stays released
            assert client.get_version() == 3

            _kill(tmp_path, "store0")  # max_restarts=1: the second death loses the node for good
            _wait_down(stores, 0)
            assert stores.check() == ["node0"] and stores.lost == ["node0"]
            assert not stores.children[0].alive() and stores.check() == ["node0"]  # never started again
            stores.wait_up()  # the nodes not lost answer
            gone = stores.outages[-1]
            assert gone.lost_at is not None and gone.back_at is None and gone.record().lost_at
            assert gone.restarts == 0  # max_store_restarts spent: not started again
            assert stores.views is not None and stores.views.down == {"node0"}
            with StoreReader(stores.locations, retries=20, backoff=0.05, timeout=5) as fresh, \
                    StoreWriter.sharing(fresh) as new_writer:  # a client started after the loss never asks node0
                assert fresh.down_nodes == {node0}
                new_writer.put_group(make_group("after-loss", size=4))
                assert fresh.scan_metadata(columns=["group_id"])["node"].unique().to_list() == [stores.locations[1]]

            _kill(tmp_path, "store1")  # max_restarts=1, but every node lost: the run cannot go on
            _wait_down(stores, 1)
            stores.check()  # store1 started again
            _kill(tmp_path, "store1")
            _wait_down(stores, 1)
            with pytest.raises(RuntimeError, match=r"every store node is lost, the last node1 \(store1\)"):
                stores.check()


def test_a_node_killed_while_a_resume_starts_the_stores_is_started_again(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the chaos run (its 10-minute run): a store node SIGKILLed while a resumed launcher waited for its
    nodes to answer failed the run. A resume starts it again, as it would later in the run (a fresh start still
    fails, naming it)."""
    import launcher.stores as stores_module

    real, killed = stores_module.answers, []

    def answers_after_a_kill(location: str) -> bool:
        if not killed and stores.children:  # the first probe: node0's process is SIGKILLed before it answers
            killed.append(_kill(tmp_path, "store0"))
            _wait_down(stores, 0)
            return False
        return real(location)

    monkeypatch.setattr(stores_module, "answers", answers_after_a_kill)
    with Children(tmp_path / "logs") as kids:
        stores = Stores(kids, _configs(tmp_path, 2), tmp_path, max_restarts=2, start_timeout_s=60)
        stores.start(fresh=False)
        try:
            (outage,) = stores.outages
            assert (outage.store, outage.cause, outage.exit_code, outage.restarts) == ("store0", "exited", -9, 1)
            assert stores.children[0].pid != killed[0] and stores.children[0].alive()
            assert stores.check() == [] and outage.back_at is not None  # it answers: the outage is over
        finally:
            stores.close()
    killed.clear()
    with Children(tmp_path / "logs") as kids:
        stores = Stores(kids, _configs(tmp_path, 2), tmp_path, max_restarts=2, start_timeout_s=60)
        with pytest.raises(RuntimeError, match=r"store node\(s\) store0(, store1)? did not come up"):
            stores.start()  # a fresh start needs every node as it is
        stores.close()


def test_the_rollout_writes_through_a_store_restart(tmp_path: Path) -> None:
    with Children(tmp_path / "logs") as kids:
        stores = Stores(kids, _configs(tmp_path, 2), tmp_path, max_restarts=3, start_timeout_s=30)
        stores.start()
        locs = stores.locations
        killed: list[float] = []

        class KillsAStore(RolloutWorker):
            def _write_group(self, batch: pa.RecordBatch, node: str, *, aborted: bool) -> None:
                super()._write_group(batch, node, aborted=aborted)
                if self.tally.groups == 6:  # mid-run: writes, stats and version polls all meet the outage
                    _kill(tmp_path, "store1")
                    killed.append(time.time())

        cfg = RolloutConfig(model="unused", stores=locs, group_size=4, max_groups=24, prompts_per_wave=4,
                            max_unreleased_groups=100, lookahead_poll_s=0.0, version_poll_s=0.0,
                            group_id_prefix="t-")
        result: dict[str, Any] = {}
        with StoreReader(locs, retries=20, backoff=0.05, timeout=5) as client, StoreWriter.sharing(client) as writer:
            with StorePublisher.sharing(client) as publisher:
                publisher.publish_version(2)
            worker = KillsAStore(cfg, client=writer, engine=FakeEngine(max_steps=3))

            def run() -> None:
                try:
                    result["report"] = worker.run()
                except Exception as exc:  # the assertion below names it
                    result["error"] = exc

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            deadline = time.monotonic() + 90
            while thread.is_alive() and time.monotonic() < deadline:
                stores.check()  # what the driver of knit run does every half second
                time.sleep(0.1)
            thread.join(timeout=1)
            assert "error" not in result, f"the rollout failed during the outage: {result.get('error')!r}"
            assert result["report"].groups == 24 and result["report"].aborted_groups == 0
            stores.wait_up()
            assert killed and [o.store for o in stores.outages] == ["store1"]
            assert stores.outages[0].died_at >= killed[0]
            # the view the client asked during the outage lists node1 down for up to VIEW_TTL_S, and scans leave
            # it out meanwhile: ask again, as its next call after VIEW_TTL_S would
            assert client.cluster_view(refresh=True).down == frozenset()
            frame = client.scan_metadata(columns=["group_id", "sample_idx"])
            assert frame.height == 24 * 4 and frame.select(["group_id", "sample_idx"]).is_unique().all()
            assert set(frame["node"].unique()) == set(locs)
            assert result["report"].policy_versions == [2]


def test_lookahead_keeps_its_last_counts_while_a_store_is_unreachable() -> None:
    from schemas.replies import GroupCounts, NodeStats

    def held(stored: int) -> dict[str, NodeStats]:
        return {"a": NodeStats.model_construct(groups=GroupCounts(stored=stored, released=0, inflight=0), demand={})}

    answers: list[Any] = [held(2), NodeUnavailableError("store node a is unavailable", node="a"), held(0)]

    def stats() -> Any:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    limit = LookaheadLimit(stats, limit=3, counts_running=True, poll_s=0.0)
    assert limit.allows(running=0)  # 2 stored < 3
    limit.note_written()
    assert not limit.allows(running=0)  # unreachable: 2 stored at the last check + 1 written since
    assert limit.allows(running=0)  # back: the stores hold nothing unreleased


def test_the_report_shows_each_outage(tmp_path: Path) -> None:
    outage = StoreOutage(store="store1", node="node1", location="grpc://127.0.0.1:1", exit_code=-9, died_at=100.0,
                         back_at=106.5, down_s=6.5, restarts=1, cause="exited")
    result = policy_summary(tmp_path, config={"policy": "mini_batch"}, wall_s=1.0, outages=[outage])
    assert result.store_outages == [outage] and result.store_restarts == 1
    assert ("store restarts (down s)", "1 (node1: 6.5)") in table_rows(result)
    quiet = policy_summary(tmp_path, config={"policy": "mini_batch"}, wall_s=1.0)
    assert quiet.store_outages == [] and ("store restarts (down s)", "0") in table_rows(quiet)
