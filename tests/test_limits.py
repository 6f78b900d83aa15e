"""A node no client can knock over: bounded requests, writers that cannot hold it hostage, strict documents.

Raw pyarrow.flight, as a careless or hostile client would call it. Each case takes seconds.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from bench.chaos.faults import flight_data
from flight_store.config import ServerConfig, StoreConfig
from flight_store.server import StoreServer
from flight_store.writing import StoreWriter
from schemas.wire import LIMITS

G = 4


def _cmd(doc: dict[str, object]) -> flight.FlightDescriptor:
    return flight.FlightDescriptor.for_command(json.dumps(doc).encode())


def _info(err: flight.FlightError) -> dict[str, Any]:
    head, _, body = err.extra_info.partition(b"\n")
    return {"class": head.decode().removeprefix("knit:"), **json.loads(body)}


def _refusal(call: Any) -> dict[str, Any]:
    with pytest.raises(flight.FlightError) as exc:
        call()
    return _info(exc.value)


def _action(client: flight.FlightClient, name: str, raw: bytes = b"") -> Any:
    (result,) = list(client.do_action(flight.Action(name, raw)))
    return json.loads(result.body.to_pybytes())


def _wait_stats(client: flight.FlightClient, done: Any, within_s: float = 10.0) -> dict[str, Any]:
    """The node's stats once ``done(stats)`` holds (polled); fails naming the last stats after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        stats = _action(client, "stats")
        if done(stats):
            return stats  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def _group(gid: str, rows: int = G, tokens: int = 3) -> pa.Table:
    return pa.table({
        "group_id": [gid] * rows, "sample_idx": pa.array(range(rows), pa.int32()), "policy_version": [0] * rows,
        "prompt_len": pa.array([1] * rows, pa.int32()), "response_len": pa.array([tokens] * rows, pa.int32()),
        "reward": pa.array([0.0] * rows, pa.float32()), "prompt_ids": pa.array([[1]] * rows, pa.list_(pa.int32())),
        "response_ids": pa.array([[2] * tokens] * rows, pa.list_(pa.int32())),
        "response_logprobs": pa.array([[-0.5] * tokens] * rows, pa.list_(pa.float32())),
    })


def _put_group(client: flight.FlightClient, table: pa.Table) -> Any:
    gid = table.column("group_id")[0].as_py()
    return _put_group_as(client, _cmd({"v": 3, "kind": "put_group", "group_id": gid, "rows": table.num_rows}), table)


def _put_group_as(client: flight.FlightClient, descriptor: flight.FlightDescriptor, table: pa.Table) -> Any:
    writer, reader = client.do_put(descriptor, table.schema)
    writer.write_table(table)
    writer.done_writing()
    buf = reader.read()
    writer.close()
    return json.loads(buf.to_pybytes())


# ---- 1. bounded requests ------------------------------------------------------------------------


def test_tickets_bodies_and_lists_are_bounded_and_the_node_keeps_serving() -> None:
    with StoreServer() as server:
        raw = flight.connect(server.location)
        _put_group(raw, _group("g"))
        huge = {"v": 3, "kind": "slices", "slices": [{"group_id": "g", "start": 0, "stop": 1}] * 300_000}
        info = _refusal(lambda: raw.do_get(flight.Ticket(json.dumps(huge).encode())).read_all())
        assert info["class"] == "LimitExceededError" and info["limit"] == "ticket_bytes" and not info["retryable"]
        many = {"v": 3, "kind": "slices", "slices": [{"group_id": "g", "start": 0, "stop": 1}] * 9000}
        info = _refusal(lambda: raw.do_get(flight.Ticket(json.dumps(many).encode())).read_all())
        assert info["limit"] == "slices_per_ticket" and info["value"] == 9000
        body = json.dumps({"v": 3, "group_ids": ["x" * 500] * 100_000}).encode()  # 50 MB
        info = _refusal(lambda: _action(raw, "release", body))
        assert info["limit"] == "action_body_bytes" and info["value"] == len(body)
        keys = {"v": 3, "kind": "images", "keys": ["ab" * 32] * 5000, "missing_ok": True}
        info = _refusal(lambda: raw.do_get(flight.Ticket(json.dumps(keys).encode())).read_all())
        assert info["limit"] == "keys_per_ticket" and info["value"] == 5000
        ids = json.dumps({"v": 3, "group_ids": [f"x{i}" for i in range(70_000)]}).encode()  # < 1 MB
        info = _refusal(lambda: _action(raw, "release", ids))
        assert info["limit"] == "groups_per_release" and info["value"] == 70_000
        desc = _cmd({"v": 3, "kind": "put_group", "group_id": "y" * 70_000, "rows": G})
        info = _refusal(lambda: _put_group_as(raw, desc, _group("g")))
        assert info["limit"] == "descriptor_bytes"
        ok = {"v": 3, "kind": "slices", "slices": [{"group_id": "g", "start": 0, "stop": 1}] * 8000}
        assert raw.do_get(flight.Ticket(json.dumps(ok).encode())).read_all().num_rows == 8000
        assert _action(raw, "health")["ok"] is True
        raw.close()


def test_a_document_of_many_keys_is_refused_in_linear_time() -> None:
    """300,000 distinct keys in one ticket (3.6 MB, under ticket_bytes): a quadratic duplicate-key check would
    keep a node's core busy for many minutes; the node refuses it within the call's deadline and keeps serving."""
    with StoreServer() as server:
        raw = flight.connect(server.location)
        doc = ("{" + ",".join(f'"k{i}":1' for i in range(300_000)) + "}").encode()
        assert len(doc) < LIMITS["ticket_bytes"]
        within = flight.FlightCallOptions(timeout=30)  # a quadratic check would time the call out instead
        info = _refusal(lambda: raw.do_get(flight.Ticket(doc), options=within).read_all())
        assert info["class"] == "WireDecodeError"
        assert _action(raw, "health")["ok"] is True
        raw.close()


def test_list_flights_answers_a_page_at_a_time() -> None:
    with StoreServer() as server, StoreWriter(server.location) as client:
        for i in range(LIMITS["groups_per_list"] + 200):
            client.put_group(_group(f"g{i:05d}", rows=1))
        raw = flight.connect(server.location)
        first = [json.loads(i.descriptor.command)["group_id"] for i in raw.list_flights()]
        assert len(first) == LIMITS["groups_per_list"] and first[0] == "g00000"
        crit = json.dumps({"v": 3, "after": first[-1]}).encode()
        rest = [json.loads(i.descriptor.command)["group_id"] for i in raw.list_flights(crit)]
        assert rest == [f"g{i:05d}" for i in range(LIMITS["groups_per_list"], LIMITS["groups_per_list"] + 200)]
        small = json.dumps({"v": 3, "limit": 5}).encode()
        assert len(list(raw.list_flights(small))) == 5
        raw.close()


def test_an_oversized_write_is_refused_as_it_arrives_not_after() -> None:
    budget = 4 << 20
    with StoreServer(ServerConfig(store=StoreConfig(memory_budget=budget))) as server:
        raw = flight.connect(server.location)
        batch = _group("big", rows=1, tokens=256 << 10).to_batches()[0]  # ~2 MiB a batch
        writer, _ = raw.do_put(_cmd({"v": 3, "kind": "put_group", "group_id": "big", "rows": 100}), batch.schema)
        sent = 0
        with pytest.raises(flight.FlightError) as exc:
            for i in range(100):  # 200 MiB announced
                writer.write_batch(batch.set_column(1, "sample_idx", pa.array([i], pa.int32())))
                sent += 1
            writer.done_writing()
            writer.close()
        assert sent < 20  # refused a few batches in, not after 200 MiB arrived
        stats = _action(raw, "stats")
        assert stats["bytes_in"] == 0 and stats["memory_in_flight"] == 0 and stats["rows"] == 0
        assert _info(exc.value)["class"] in ("CapacityExceededError", "BudgetExceededError")
        raw.close()


def test_a_weights_put_of_zero_batches_or_a_bad_table_is_refused_and_the_node_restarts(tmp_path) -> None:
    store = StoreConfig(spill_dir=str(tmp_path))
    schema = pa.schema([("name", pa.string()), ("shape", pa.list_(pa.int32())), ("dtype", pa.string()),
                        ("data", pa.large_binary())])
    with StoreServer(ServerConfig(store=store)) as server:
        raw = flight.connect(server.location)
        writer, _ = raw.do_put(_cmd({"v": 3, "kind": "put_weights", "version": 1}), schema)
        with pytest.raises(flight.FlightError, match="holds no tensor"):
            writer.done_writing()
            writer.close()
        bad = pa.table({"name": ["w", "w"], "shape": [[1], [1]], "dtype": ["int16", "int16"],
                        "data": [b"\0\0", b"\0\0"]}, schema=schema)
        writer, _ = raw.do_put(_cmd({"v": 3, "kind": "put_weights", "version": 1}), schema)
        with pytest.raises(flight.FlightError, match="'w' is empty or repeated"):
            writer.write_table(bad)
            writer.done_writing()
            writer.close()
        assert _refusal(lambda: raw.do_get(flight.Ticket(b'{"v": 3, "kind": "weights"}')).read_all())[
            "class"] == "UnknownWeightsError"
        raw.close()
    with StoreServer(ServerConfig(store=store)) as again:  # nothing poisonous was logged
        assert again.store.recovered["records"] == 0


# ---- 4. writers that cannot hold a node hostage ----------------------------------------------------


def test_idle_writers_lose_their_slot_and_honest_writers_get_through() -> None:
    config = ServerConfig(max_writers=8, write_idle_timeout_s=1.0, store=StoreConfig(memory_budget=1 << 20))
    with StoreServer(config) as server:
        raw = flight.connect(server.location)
        schema = _group("x").schema
        idle = []
        for i in range(12):  # open streams that never send a batch (beyond 8, the node refuses them)
            client = flight.connect(server.location)
            writer, _ = client.do_put(_cmd({"v": 3, "kind": "put_group", "group_id": f"idle{i}", "rows": G}), schema)
            idle.append((client, writer))
        stats = _wait_stats(raw, lambda st: st["writers"] == 8)
        assert stats["memory_in_flight"] == 0  # idle streams reserve no memory
        stats = _wait_stats(raw, lambda st: st["writers"] == 0)  # past the idle limit: their slots are free again
        assert stats["writes_given_up"] >= 8
        assert _put_group(raw, _group("honest")) == {"group_id": "honest", "rows_added": G}
        client, writer = idle[0]
        with pytest.raises(flight.FlightError) as exc:  # an idle writer that resumes is refused, retryably
            writer.write_table(_group("idle0"))
            writer.done_writing()
            writer.close()
        assert _info(exc.value)["class"] in ("WriteTimedOutError", "TooManyWritersError")
        assert _info(exc.value)["retryable"] is True
        for c, w in idle[1:]:  # the stalled writers end their streams: each is refused, nothing stored
            with pytest.raises(flight.FlightError):
                w.close()
            c.close()
        client.close()
        assert server.store.group_ids() == ["honest"]
        raw.close()


def test_writers_beyond_the_cap_are_refused_retryably_and_the_client_retries() -> None:
    config = ServerConfig(max_writers=1, write_idle_timeout_s=30.0)
    with StoreServer(config) as server:
        slow = flight.connect(server.location)
        writer, _ = slow.do_put(_cmd({"v": 3, "kind": "put_group", "group_id": "slow", "rows": G}), _group("a").schema)
        raw = flight.connect(server.location)
        _wait_stats(raw, lambda st: st["writers"] == 1)  # the slow writer holds the one slot
        info = _refusal(lambda: _put_group(raw, _group("b")))
        assert info["class"] == "TooManyWritersError" and info["retryable"] is True and info["limit"] == 1
        timer = threading.Timer(0.5, lambda: (writer.write_table(_group("slow")), writer.done_writing(),
                                              writer.close()))
        timer.start()
        with StoreWriter(server.location, retries=6, backoff=0.1) as client:
            client.put_group(_group("b"))  # retried until the slot is free
        timer.join()
        assert sorted(server.store.group_ids()) == ["b", "slow"]
        raw.close()
        slow.close()


def _hold_idle_streams(location: str, n: int) -> tuple[flight.FlightClient, list[Any]]:
    """One client (one connection) opening ``n`` DoPut streams that never send a batch."""
    hog = flight.connect(location)
    schema = _group("x").schema
    return hog, [hog.do_put(_cmd({"v": 3, "kind": "put_group", "group_id": f"idle{i}", "rows": G}), schema)[0]
                 for i in range(n)]


def _end_streams(hog: flight.FlightClient, writers: list[Any]) -> list[dict[str, Any]]:
    """End every stream of ``hog`` (each is refused: none sent a group); the refusals' JSON."""
    refusals = []
    for w in writers:
        with pytest.raises(flight.FlightError) as exc:
            w.close()
        refusals.append(_info(exc.value) if exc.value.extra_info.startswith(b"knit:") else {"class": "other"})
    hog.close()
    return refusals


@pytest.mark.parametrize("per_peer", [16, 64])
def test_a_client_holding_300_idle_streams_fills_its_own_share_not_the_node(per_peer: int) -> None:
    """One connection holds 300 idle DoPuts. With the per-peer share below the node's cap, an honest writer's put
    succeeds at once, no retry, while they are held. With a share as large as the cap, the hog fills the node: the
    honest put is refused until a held stream has been idle for ``write_evict_idle_s``, then takes its slot."""
    config = ServerConfig(max_writers=64, max_writers_per_peer=per_peer, write_idle_timeout_s=30.0)
    with StoreServer(config) as server:
        hog, writers = _hold_idle_streams(server.location, 300)
        raw = flight.connect(server.location)
        _wait_stats(raw, lambda st: st["writers"] == per_peer)
        with StoreWriter(server.location, timeout=2.0, retries=0) as honest:
            if per_peer == config.max_writers:
                time.sleep(config.write_evict_idle_s)  # every held stream is now evictable
            honest.put_group(_group("honest"))  # a slot at first try, while the 300 are held
        stats = _action(raw, "stats")
        assert stats["writes_evicted"] == (1 if per_peer == config.max_writers else 0)
        assert stats["writers"] == per_peer - stats["writes_evicted"]  # the hog's other streams are still open
        refusals = _end_streams(hog, writers)
        over = [r for r in refusals if r["class"] == "TooManyPeerWritersError"]
        assert len(over) == 300 - per_peer
        assert over[0]["limit"] == per_peer and over[0]["retryable"] is True
        assert over[0]["peer"].startswith("ipv4:127.0.0.1:")
        evicted = [r for r in refusals if r["class"] == "WriteTimedOutError"]
        assert len(evicted) == stats["writes_evicted"] and all(r["retryable"] for r in evicted)
        assert server.store.group_ids() == ["honest"]
        _wait_stats(raw, lambda st: st["writers"] == 0)
        raw.close()


def test_300_connections_holding_an_idle_put_each_cannot_lock_an_honest_writer_out() -> None:
    """300 connections, one idle DoPut each (a hostile client, or a rollout reconnecting in a loop), fill the node's
    64 slots over and over; an honest put whose whole budget is 2 s (its call deadline, retries inside it) still
    gets in, by taking the slot of the stream idle longest, and every idle stream is refused when it ends."""
    config = ServerConfig(max_writers=64, write_idle_timeout_s=30.0)
    with StoreServer(config) as server:
        schema = _group("x").schema
        hogs = []
        for i in range(300):
            client = flight.connect(server.location)
            writer, _ = client.do_put(_cmd({"v": 3, "kind": "put_group", "group_id": f"idle{i}", "rows": G}), schema)
            hogs.append((client, writer))
        raw = flight.connect(server.location)
        _wait_stats(raw, lambda st: st["writers"] == 64)
        with StoreWriter(server.location, timeout=2.0, retries=3, backoff=0.25) as honest:  # 0.25+0.5+1 s of waits
            honest.put_group(_group("honest"))
        assert _action(raw, "stats")["writes_evicted"] >= 1
        classes = set()
        for client, writer in hogs:
            with pytest.raises(flight.FlightError) as exc:
                writer.close()
            classes.add(_info(exc.value)["class"])
            client.close()
        # evicted (WriteTimedOutError), refused on arrival (TooManyWritersError), or still held and ended without
        # the rows it declared (SchemaMismatchError): nothing of theirs is stored
        assert "WriteTimedOutError" in classes
        assert classes <= {"WriteTimedOutError", "TooManyWritersError", "SchemaMismatchError"}
        assert server.store.group_ids() == ["honest"]
        _wait_stats(raw, lambda st: st["writers"] == 0)
        raw.close()


def test_a_slow_writer_that_keeps_sending_is_never_evicted() -> None:
    """A full node (2 slots, eviction after 0.5 s idle): a writer sends its group a row every 0.1 s for 3 s while
    a newcomer arrives every 0.3 s and takes the other slot once its holder idled 0.5 s; the slow writer keeps its
    slot, and its group is stored whole."""
    rows = 30
    config = ServerConfig(max_writers=2, write_idle_timeout_s=30.0, write_evict_idle_s=0.5)
    with StoreServer(config) as server:
        slow_client = flight.connect(server.location)
        table = _group("slow", rows=rows)
        writer, reader = slow_client.do_put(_cmd({"v": 3, "kind": "put_group", "group_id": "slow", "rows": rows}),
                                            table.schema)
        done = threading.Event()
        newcomers: list[tuple[flight.FlightClient, Any]] = []

        def crowd() -> None:
            while not done.wait(0.3):  # an idle stream at a time
                client = flight.connect(server.location)
                with contextlib.suppress(flight.FlightError):
                    w, _ = client.do_put(_cmd({"v": 3, "kind": "put_group", "group_id": f"n{len(newcomers)}",
                                               "rows": G}), table.schema)
                    newcomers.append((client, w))

        crowder = threading.Thread(target=crowd)
        crowder.start()
        for i in range(rows):
            writer.write_table(table.slice(i, 1))
            time.sleep(0.1)
        done.set()
        crowder.join()
        writer.done_writing()
        answer = json.loads(reader.read().to_pybytes())
        writer.close()
        assert answer == {"group_id": "slow", "rows_added": rows}
        assert _action(slow_client, "stats")["writes_evicted"] >= 2  # the newcomers did evict each other
        for client, w in newcomers:
            with contextlib.suppress(flight.FlightError):
                w.close()
            client.close()
        assert server.store.group_ids() == ["slow"]
        slow_client.close()


# ---- 6. strict documents and quiet errors ----------------------------------------------------------


def test_versions_are_bounded_so_none_can_freeze_the_node() -> None:
    with StoreServer() as server:
        raw = flight.connect(server.location)
        info = _refusal(lambda: _action(raw, "publish_version", json.dumps({"v": 3, "version": 2**62}).encode()))
        assert info["class"] == "WireDecodeError"
        info = _refusal(lambda: _action(raw, "publish_version", json.dumps({"v": 3, "version": 2**30}).encode()))
        assert info["class"] == "LimitExceededError" and info["limit"] == "version_step"
        assert _action(raw, "publish_version", json.dumps({"v": 3, "version": 7}).encode()) == {"version": 7}
        assert _action(raw, "publish_version", json.dumps({"v": 3, "version": 8}).encode()) == {"version": 8}
        raw.close()


def test_an_internal_error_names_an_incident_not_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    with StoreServer() as server:
        def broken() -> None:
            raise KeyError("_internal_secret_field")

        monkeypatch.setattr(server.store, "stats", broken)
        raw = flight.connect(server.location)
        with pytest.raises(flight.FlightInternalError) as exc:
            _action(raw, "stats")
        text = str(exc.value)
        assert "incident" in text and "KeyError" not in text and "_internal_secret_field" not in text
        assert "Traceback" not in text
        raw.close()


def test_metrics_listen_on_the_node_host() -> None:
    pytest.importorskip("prometheus_client")
    import urllib.error
    import urllib.request

    with StoreServer(ServerConfig(host="127.0.0.2", metrics_port=0)) as server:  # not the default 127.0.0.1
        body = urllib.request.urlopen(f"http://127.0.0.2:{server.metrics_port}/metrics", timeout=10).read()
        assert b"knit_rows" in body
        with pytest.raises(urllib.error.URLError):  # bound to the node's host only, not every address
            urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10)


def test_idle_calls_never_lock_out_writes_through_the_rss_guard(node_process) -> None:
    """A node process with the RSS guard and a 32 MiB budget: 400 connections each holding an idle read channel
    (a thread and ~150 KiB of gRPC's memory apiece, past the budget in all) and 100 holding an idle DoPut; an
    honest write still goes in, and the held calls are all served when their clients move on."""
    _, location = node_process(ServerConfig(log_level="WARNING", store=StoreConfig(memory_budget=32 << 20)))
    raw = flight.connect(location)
    assert _put_group(raw, _group("first", tokens=64))["rows_added"] == G  # the guard applies once a group is held
    reads = flight.FlightDescriptor.for_command(json.dumps({"v": 3, "kind": "reads"}).encode())
    held = []
    for _ in range(400):
        client = flight.connect(location)
        held.append((client, client.do_exchange(reads)))
    schema = _group("x").schema
    puts = []
    for i in range(100):
        client = flight.connect(location)
        puts.append((client, client.do_put(_cmd({"v": 3, "kind": "put_group", "group_id": f"idle{i}", "rows": G}),
                                           schema)[0]))
    stats = _wait_stats(raw, lambda st: st["writers"] == 64)
    assert stats["memory_rss"] > stats["memory_rss_limit"]  # what the held calls hold: past the budget
    with StoreWriter(location, timeout=5.0, retries=5, backoff=0.25) as honest:
        honest.put_group(_group("honest", tokens=64))
    client, (writer, reader) = held[0]  # a held channel still answers its first request
    ticket = json.dumps({"v": 3, "kind": "slices", "slices": [{"group_id": "honest", "start": 0, "stop": G}]})
    writer.write_metadata(pa.py_buffer(ticket.encode()))
    assert reader.read_chunk().data.num_rows == G
    for client, (writer, _) in held:
        writer.done_writing()
        client.close()
    for client, writer in puts:
        with pytest.raises(flight.FlightError):
            writer.close()
        client.close()
    assert _action(raw, "stats")["groups"]["stored"] == 2  # first and honest; nothing of the idle puts
    raw.close()


def test_reads_never_lock_out_writes_on_a_node_holding_its_memory(node_process) -> None:
    """A node process with the RSS guard: the largest reads it takes leave room for every honest write."""
    _, location = node_process(ServerConfig(log_level="WARNING", store=StoreConfig(memory_budget=32 << 20)))
    raw = flight.connect(location)
    for i in range(40):
        _put_group(raw, _group(f"g{i}", tokens=64))
    huge = {"v": 3, "kind": "slices", "slices": [{"group_id": "g0", "start": 0, "stop": 1}] * 300_000}
    for _ in range(3):  # refused before it is parsed: it borrows no memory
        assert _refusal(lambda: raw.do_get(flight.Ticket(json.dumps(huge).encode())).read_all())["class"] == \
            "LimitExceededError"
    big = {"v": 3, "kind": "slices", "slices": [{"group_id": f"g{i % 40}", "start": 0, "stop": G}
                                                for i in range(LIMITS["slices_per_ticket"])]}
    for k in range(5):  # the largest ticket the node takes, full metadata scans: each write right after goes in
        assert raw.do_get(flight.Ticket(json.dumps(big).encode())).read_all().num_rows == G * len(big["slices"])
        assert _put_group(raw, _group(f"after-read-{k}", tokens=64))["rows_added"] == G
        raw.do_get(flight.Ticket(b'{"v": 3, "kind": "metadata"}')).read_all()
        list(raw.list_flights())
        assert _put_group(raw, _group(f"after-scan-{k}", tokens=64))["rows_added"] == G
    stats = _action(raw, "stats")
    assert stats["memory_rss"] < stats["memory_rss_limit"]  # what the reads borrowed went back
    raw.close()


def test_readers_that_stop_mid_answer_lock_nobody_out(node_process) -> None:
    """A node process with the RSS guard: 20 clients each read the first batch of the largest answer the node
    takes (about 8 MiB, more than gRPC's flow-control windows hold) and stop reading, keeping their calls open;
    honest writes, reads and stats go on, and once the stalled clients go away a full read works again."""
    _, location = node_process(ServerConfig(log_level="WARNING", store=StoreConfig(memory_budget=32 << 20)))
    raw = flight.connect(location)
    for i in range(40):
        _put_group(raw, _group(f"g{i}", tokens=64))
    big = json.dumps({"v": 3, "kind": "slices", "slices": [{"group_id": f"g{i % 40}", "start": 0, "stop": G}
                                                           for i in range(LIMITS["slices_per_ticket"])]}).encode()
    stalled = []
    for _ in range(20):
        client = flight.connect(location)
        reader = client.do_get(flight.Ticket(big))
        assert reader.read_chunk().data.num_rows > 0  # the answer has begun; nothing more is read
        stalled.append((client, reader))
    for k in range(5):
        assert _put_group(raw, _group(f"honest{k}", tokens=64))["rows_added"] == G
        ticket = json.dumps({"v": 3, "kind": "slices", "slices": [{"group_id": f"honest{k}", "start": 0, "stop": G}]})
        assert raw.do_get(flight.Ticket(ticket.encode())).read_all().num_rows == G
    assert _action(raw, "stats")["groups"]["stored"] == 45
    for client, _ in stalled:
        client.close()
    assert raw.do_get(flight.Ticket(big)).read_all().num_rows == G * LIMITS["slices_per_ticket"]
    raw.close()


# ---- malformed streams from a raw gRPC client -------------------------------------------------------


def _raw_put(location: str, messages: list[bytes]) -> str:
    """The status details a DoPut of ``messages`` (raw ``FlightData`` bytes) is refused with."""
    from bench.chaos.faults import raw_put

    refused = raw_put(location, messages)
    assert refused is not None, "the node took the stream"
    return refused


def test_garbage_ipc_from_a_raw_grpc_client_is_refused_naming_it_and_the_node_serves_on() -> None:
    """A raw gRPC client's DoPuts: a first message that is not Arrow IPC (Flight refuses it before the node reads
    it), then a valid schema followed by a garbage message, and one followed by a batch cut short (the node refuses
    each as a WireDecodeError naming the message, no internal error); nothing stored, honest writes go on."""
    table = _group("junk")
    schema_header = pa.ipc.read_message(table.schema.serialize()).metadata.to_pybytes()
    batch = pa.ipc.read_message(table.to_batches()[0].serialize())
    header, body = batch.metadata.to_pybytes(), batch.body.to_pybytes()
    doc = json.dumps({"v": 3, "kind": "put_group", "group_id": "junk", "rows": G}).encode()
    with StoreServer() as server:
        first = _raw_put(server.location, [flight_data(doc, b"\xff" * 64, b"\x00" * 256)])
        assert "Invalid flatbuffers message" in first
        garbage = flight_data(None, b"\xfe" * 32, b"\x01" * 64)
        for second in (garbage, flight_data(None, header, body[:len(body) // 2])):  # garbage, a batch cut short
            refused = _raw_put(server.location, [flight_data(doc, schema_header), second])
            assert "message 1 of the stream is not an Arrow IPC record batch" in refused
            assert "internal error" not in refused
        raw = flight.connect(server.location)
        assert _put_group(raw, _group("honest")) == {"group_id": "honest", "rows_added": G}
        assert server.store.group_ids() == ["honest"]
        raw.close()
