"""The wire contract against any client and any fault, with raw pyarrow.flight where docs/protocol.md is the contract.

Covers: a group write is atomic (five ways a stream can end early, with and without a spill log, and a
restart), routing is part of the protocol (rendezvous over node ids, the ``cluster`` action, a node
refusing a group that is not its own), errors say whether to retry, content is checked (image keys,
unknown image references, a rewrite with other content), the schema's edges, corrupt batches, and
what the store keeps (the writer's logprob mode, released groups visible as such).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from flight_store.config import ClusterMember, ServerConfig, StoreConfig
from flight_store.reading import StoreReader
from flight_store.server import StoreServer
from flight_store.writing import StoreWriter

ROOT = Path(__file__).resolve().parents[1]
G = 4


# ---- what a client in any language writes, from docs/protocol.md alone -----------------------------------


def _cmd(doc: dict[str, object]) -> flight.FlightDescriptor:
    return flight.FlightDescriptor.for_command(json.dumps(doc).encode())


def _action(client: flight.FlightClient, name: str, body: dict[str, object] | None = None) -> Any:
    (result,) = list(client.do_action(flight.Action(name, json.dumps(body).encode() if body else b"")))
    return json.loads(result.body.to_pybytes())


def _group(gid: str, rows: int = G, **columns: Any) -> pa.Table:
    data: dict[str, Any] = {
        "group_id": [gid] * rows, "sample_idx": list(range(rows)), "policy_version": [1] * rows,
        "prompt_len": [2] * rows, "response_len": [3] * rows, "reward": [float(i % 2) for i in range(rows)],
        "prompt_ids": [[1, 2]] * rows, "response_ids": [[5, 6, 7]] * rows, "response_logprobs": [[-0.5] * 3] * rows,
    }
    data.update(columns)
    types = {"group_id": pa.string(), "sample_idx": pa.int32(), "policy_version": pa.int64(), "prompt_len": pa.int32(),
             "response_len": pa.int32(), "reward": pa.float32(), "prompt_ids": pa.list_(pa.int32()),
             "response_ids": pa.list_(pa.int32()), "response_logprobs": pa.list_(pa.float32())}
    return pa.table({k: pa.array(v, types.get(k)) if not isinstance(v, pa.Array) else v for k, v in data.items()})


def _put(client: flight.FlightClient, doc: dict[str, object], table: pa.Table, **opts: Any) -> Any:
    writer, reader = client.do_put(_cmd(doc), table.schema, flight.FlightCallOptions(**opts))
    writer.write_table(table)
    writer.done_writing()
    buf = reader.read()
    writer.close()
    return json.loads(buf.to_pybytes())


def _put_group(client: flight.FlightClient, table: pa.Table, rows: int | None = None) -> Any:
    gid = table.column("group_id")[0].as_py()
    return _put(client, {"v": 3, "kind": "put_group", "group_id": gid, "rows": rows or table.num_rows}, table)


def _refusal(call: Any) -> flight.FlightError:
    with pytest.raises(flight.FlightError) as exc:
        call()
    return exc.value


def _info(err: flight.FlightError) -> dict[str, Any]:
    """The protocol's error info: ``knit:<Class>`` then a JSON object (message, retryable, fields)."""
    head, _, body = err.extra_info.partition(b"\n")
    return {"class": head.decode().removeprefix("knit:"), **json.loads(body)}


def _stored(client: flight.FlightClient) -> list[str]:
    meta = client.do_get(flight.Ticket(json.dumps({"v": 3, "kind": "metadata", "columns": ["group_id"]}).encode()))
    return sorted(set(meta.read_all().column("group_id").to_pylist()))


# ---- 1. atomic group writes ----------------------------------------------------------------------


_KILLED_WRITER = textwrap.dedent("""
    import json, os, sys, time
    import pyarrow as pa, pyarrow.flight as flight
    table = pa.ipc.open_file(sys.argv[2]).read_all()
    client = flight.connect(sys.argv[1])
    doc = {"v": 3, "kind": "put_group", "group_id": "g", "rows": 4}
    writer, _ = client.do_put(flight.FlightDescriptor.for_command(json.dumps(doc).encode()), table.schema)
    writer.write_table(table.slice(0, 2))
    time.sleep(0.3)
    os._exit(1)  # killed mid-stream: no done_writing, no close
""")


def _end_early(how: str, location: str, tmp: Path) -> None:
    """Write 2 of the 4 rows a put_group declares, then end the stream as ``how`` says."""
    table = _group("g")
    doc = {"v": 3, "kind": "put_group", "group_id": "g", "rows": G}
    if how == "killed":
        path = tmp / "group.arrow"
        with pa.ipc.new_file(path, table.schema) as f:
            f.write_table(table)
        proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, location, str(path)], timeout=60, check=False)
        assert proc.returncode == 1
        return
    client = flight.connect(location)
    timeout = 0.5 if how == "deadline" else None
    writer, _ = client.do_put(_cmd(doc), table.schema, flight.FlightCallOptions(timeout=timeout))
    if how == "exception":  # leaving ``with writer:`` closes the stream: the node refuses the short group
        with pytest.raises(flight.FlightError, match="declares 4 rows but its stream carried 2"), writer:
            writer.write_table(table.slice(0, 2))
            raise RuntimeError("engine crashed")
    else:
        writer.write_table(table.slice(0, 2))
        if how == "closed":
            with pytest.raises(flight.FlightError, match="declares 4 rows but its stream carried 2"):
                writer.close()  # half-closes after 2 rows: the node refuses the short group
        elif how == "deadline":
            time.sleep(1.0)
            with pytest.raises(flight.FlightError):
                writer.close()
        elif how == "client_closed":
            client.close()
    client.close()


ENDINGS = ["closed", "exception", "killed", "deadline", "client_closed"]


@pytest.mark.parametrize("spill", [False, True], ids=["memory", "spill"])
@pytest.mark.parametrize("how", ENDINGS)
def test_a_stream_that_ends_early_stores_nothing(how: str, spill: bool, tmp_path: Path) -> None:
    store = StoreConfig(spill_dir=str(tmp_path / "spill") if spill else None, memory_budget=1 << 26)
    server = StoreServer(ServerConfig(store=store))
    try:
        _end_early(how, server.location, tmp_path)
        deadline = time.monotonic() + 10
        while server.store.stats().memory_in_flight and time.monotonic() < deadline:
            time.sleep(0.05)  # the server notices the broken stream on its own time
        client = flight.connect(server.location)
        assert _stored(client) == []
        stats = _action(client, "stats")
        assert stats["rows"] == 0 and stats["memory_used"] == 0 and stats["memory_in_flight"] == 0
        assert _put_group(client, _group("g")) == {"group_id": "g", "rows_added": G}  # the retry stores it whole
        client.close()
    finally:
        server.shutdown()
    if spill:  # the log holds the whole group once, nothing of the broken stream
        again = StoreServer(ServerConfig(store=store))
        try:
            assert again.store.metadata().column("sample_idx").to_pylist() == list(range(G))
            assert again.store.recovered["records"] == 1
        finally:
            again.shutdown()


# ---- 2. routing ----------------------------------------------------------------------------------


ROUTING_VECTORS = [("step0-p0", "node1"), ("step0-p1", "node0"), ("g1", "node2"), ("mini_batch-7", "node0"),
                   ("prompt-42", "node2"), ("node0/g1", "node0"), ("node2/step0-p0", "node2"),
                   ("node7/g1", "node2"), ("node1", "node2"), ("node1g1", "node2")]
"""(group id, owner) over the ids node0, node1, node2, as docs/protocol.md lists them."""


def _readme_owner(group_id: str, ids: list[str]) -> str:
    """The protocol's routing, written from its text alone."""
    homes = [n for n in ids if group_id.startswith(n + "/")]
    if homes:
        return max(homes, key=len)

    def score(node: str) -> tuple[int, bytes]:
        digest = hashlib.sha256(node.encode() + b"\x00" + group_id.encode()).digest()
        return int.from_bytes(digest[:8], "big"), node.encode()

    return max(ids, key=score)


def test_routing_test_vectors_and_a_hand_written_client_agree() -> None:
    from schemas.routing import home_id, owner

    ids = ["node0", "node1", "node2"]
    for gid, want in ROUTING_VECTORS:
        assert owner(gid, ids) == _readme_owner(gid, ids) == want
    gids = [f"group-{i}" for i in range(500)]
    assert all(owner(g, ids) == _readme_owner(g, list(reversed(ids))) for g in gids)  # node order is irrelevant
    moved = sum(owner(g, ids) != owner(g, [*ids, "node3"]) for g in gids)
    assert 0.15 < moved / len(gids) < 0.35  # adding a 4th node moves about a quarter, all to it
    assert all(owner(g, [*ids, "node3"]) == "node3" for g in gids if owner(g, ids) != owner(g, [*ids, "node3"]))
    homed = [home_id(ids[i % 3], g) for i, g in enumerate(gids)]
    assert [owner(g, ids) for g in homed] == [ids[i % 3] for i in range(len(gids))]  # local placement
    assert all(owner(g, [*ids, "node3"]) == owner(g, ids) for g in homed)  # a new node takes no homed group
    alive = ["node0", "node2"]  # node1 down: its homed groups fall back to the hash over the nodes alive
    assert [owner(g, alive) for g in homed] == [_readme_owner(g, alive) for g in homed]
    assert {owner(g, alive) for g in homed if g.startswith("node1/")} == {"node0", "node2"}
    assert owner("a/b/g", ["a", "a/b"]) == _readme_owner("a/b/g", ["a", "a/b"]) == "a/b"  # the longest home id
    with pytest.raises(ValueError, match="node id and a rest"):
        home_id("", "g")


def test_a_node_refuses_a_group_routing_gives_another_naming_it(tmp_path: Path) -> None:
    from flight_store.net import free_port

    ports = [free_port() for _ in range(3)]
    members = [ClusterMember(id=f"node{i}", location=f"grpc://127.0.0.1:{p}") for i, p in enumerate(ports)]
    servers = [StoreServer(ServerConfig(port=p, node_name=f"node{i}", cluster=members, cluster_version=3))
               for i, p in enumerate(ports)]
    try:
        raw = flight.connect(servers[0].location)
        view = _action(raw, "cluster")
        assert view == {"routing": "home-rendezvous-sha256", "version": 3, "self": "node0",
                        "nodes": [{"id": m.id, "location": m.location} for m in members], "down": []}
        ids = [n["id"] for n in view["nodes"]]
        mine = next(f"g{i}" for i in range(99) if _readme_owner(f"g{i}", ids) == "node0")
        other = next(f"g{i}" for i in range(99) if _readme_owner(f"g{i}", ids) == "node2")
        assert _put_group(raw, _group(mine)) == {"group_id": mine, "rows_added": G}
        err = _refusal(lambda: _put_group(raw, _group(other)))
        info = _info(err)
        assert info["class"] == "WrongNodeError" and info["owner"] == "node2"
        assert info["location"] == members[2].location
        assert info["retryable"] is False and "node2" in str(err)
        assert _stored(raw) == [mine]
        with StoreWriter.from_cluster(servers[1].location) as client:  # one location is enough to find them all
            assert sorted(client.nodes) == sorted(m.location for m in members)
            assert client.put_group(_group(other).to_batches()[0]) == members[2].location
        part = StoreReader([m.location for m in members[:2]])
        with pytest.raises(ValueError, match="belongs to the cluster"):
            part.node_for("x")  # a client that knows only part of the cluster would route wrong
        part.close()
        raw.close()
    finally:
        for s in servers:
            s.shutdown()


# ---- 3. errors that say whether to retry ---------------------------------------------------------


def test_local_placement_a_retry_a_lost_home_node_and_a_raw_client_routing_by_the_spec() -> None:
    """A group id naming its home node: the home takes it and a retry is a no-op, the others refuse it naming the
    home; with the home down (``set_cluster``) every node, the Python client and a raw client agree on the hash
    owner over the nodes alive, and the home itself refuses it."""
    from flight_store.net import free_port

    ports = [free_port() for _ in range(3)]
    members = [ClusterMember(id=f"node{i}", location=f"grpc://127.0.0.1:{p}") for i, p in enumerate(ports)]
    servers = [StoreServer(ServerConfig(port=p, node_name=f"node{i}", cluster=members, cluster_version=1))
               for i, p in enumerate(ports)]
    raw = [flight.connect(s.location) for s in servers]
    try:
        ids = [n["id"] for n in _action(raw[0], "cluster")["nodes"]]
        gid = "node1/r7-p3"
        assert _readme_owner(gid, ids) == "node1"
        assert _put_group(raw[1], _group(gid)) == {"group_id": gid, "rows_added": G}
        assert _put_group(raw[1], _group(gid)) == {"group_id": gid, "rows_added": 0}  # the retry of an unknown outcome
        err = _refusal(lambda: _put_group(raw[0], _group(gid)))
        info = _info(err)
        assert info["class"] == "WrongNodeError" and info["owner"] == "node1" and "its id names that node" in str(err)
        for r in raw:  # the watcher marks node1 down
            assert _action(r, "set_cluster", {"v": 3, "version": 2, "down": ["node1"]})["down"] == ["node1"]
        later = "node1/r7-p4"
        alive = [i for i in ids if i != "node1"]
        fallback = _readme_owner(later, alive)
        assert fallback in alive
        with StoreWriter([m.location for m in members]) as client:
            assert client.node_for(later) == members[ids.index(fallback)].location
        err = _refusal(lambda: _put_group(raw[1], _group(later)))  # the home itself routes by the view
        refused = _info(err)
        assert refused["class"] == "WrongNodeError" and refused["owner"] == fallback
        assert "rendezvous hashing" in str(err)
        assert _put_group(raw[ids.index(fallback)], _group(later)) == {"group_id": later, "rows_added": G}
        assert _stored(raw[1]) == [gid] and _stored(raw[ids.index(fallback)]) == [later]
    finally:
        for r in raw:
            r.close()
        for s in servers:
            s.shutdown()


def test_a_write_larger_than_the_node_is_refused_for_good(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with StoreServer(ServerConfig(store=StoreConfig(memory_budget=64 << 10))) as server:
        raw = flight.connect(server.location)
        big = _group("big", response_ids=[[7] * 5000] * G, response_len=[5000] * G,
                     response_logprobs=[[-0.5] * 5000] * G)
        info = _info(_refusal(lambda: _put_group(raw, big)))
        assert info["class"] == "CapacityExceededError" and info["retryable"] is False
        assert info["capacity"] == 64 << 10 and info["needed"] > info["capacity"]
        with StoreWriter(server.location, retries=5, backoff=2.0) as client:  # one retry would wait 2 s
            from flight_store.errors import CapacityExceededError

            caplog.set_level(logging.WARNING, logger="flight_store")
            with pytest.raises(CapacityExceededError):
                client.put_group(big)  # the client does not retry what can never succeed
            assert not [r for r in caplog.records if "retrying" in r.getMessage()]
        assert _stored(raw) == []
        raw.close()


# ---- 4. content integrity ------------------------------------------------------------------------


def _image_rows(data: bytes, shape: list[int], key: bytes | None = None) -> pa.Table:
    key = key or hashlib.sha256(f"|u1|{','.join(map(str, shape))}|".encode() + data).digest()
    return pa.table({"image_key": pa.array([key], pa.binary(32)), "shape": pa.array([shape], pa.list_(pa.int32())),
                     "dtype": ["uint8"], "data": pa.array([data], pa.large_binary())})


def test_content_is_checked_image_keys_references_and_rewrites() -> None:
    with StoreServer() as server:
        raw = flight.connect(server.location)
        pixels = bytes(range(12))
        good = _image_rows(pixels, [3, 4])
        wrong = _image_rows(pixels, [3, 4], key=bytes(32))
        info = _info(_refusal(lambda: _put(raw, {"v": 3, "kind": "put_images"}, wrong)))
        assert info["class"] == "SchemaMismatchError" and info["column"] == "image_key"
        short = _image_rows(pixels[:5], [3, 4])
        assert _info(_refusal(lambda: _put(raw, {"v": 3, "kind": "put_images"}, short)))["column"] == "data"
        key = good.column("image_key")[0].as_py()
        keys = pa.array([[key]] * G, pa.list_(pa.binary(32)))
        info = _info(_refusal(lambda: _put_group(raw, _group("img", image_keys=keys))))
        assert info["class"] == "UnknownImageError" and info["key"] == key.hex()  # its images come first
        assert _put(raw, {"v": 3, "kind": "put_images"}, good) == {"stored": 1}
        assert _put_group(raw, _group("img", image_keys=keys))["rows_added"] == G
        assert _put_group(raw, _group("img", image_keys=keys))["rows_added"] == 0  # identical: idempotent
        info = _info(_refusal(lambda: _put_group(raw, _group("img", reward=[9.0] * G))))
        assert info["class"] == "ConflictError" and info["column"] == "reward" and info["retryable"] is False
        assert _stored(raw) == ["img"]
        raw.close()


# ---- 5, 6. the schema's edges and corrupt batches -----------------------------------------------------


def _corrupt_offsets() -> pa.Array:
    values = pa.array([5, 6, 7, 8], pa.int32())
    offsets = pa.array([0, 3, 1, 4, 4], pa.int32())  # non-monotonic: row 1 would have -2 values
    return pa.ListArray.from_buffers(pa.list_(pa.int32()), G, [None, offsets.buffers()[1]], children=[values])


EDGES: list[tuple[str, dict[str, Any], str]] = [
    ("gap", {"sample_idx": [0, 1, 2, 9]}, "sample_idx"),
    ("nan_reward", {"reward": [0.0, float("nan"), 1.0, 0.0]}, "reward"),
    ("inf_reward", {"reward": [0.0, float("inf"), 1.0, 0.0]}, "reward"),
    ("mask_2", {"loss_mask": pa.array([[1, 2, 1]] * G, pa.list_(pa.uint8()))}, "loss_mask"),
    ("versions", {"policy_version_min": [2] * G}, "policy_version_min"),
    ("list_view", {"response_ids": pa.array([[5, 6, 7]] * G, pa.list_view(pa.int32()))}, "response_ids"),
    ("corrupt_offsets", {"response_ids": _corrupt_offsets()}, "response_ids"),
    ("negative_len", {"response_len": [3, -3, 3, 3]}, "response_len"),
]


@pytest.mark.parametrize(("name", "columns", "column"), EDGES, ids=[e[0] for e in EDGES])
def test_a_batch_breaking_a_rule_is_refused_naming_its_column(name: str, columns: dict[str, Any], column: str) -> None:
    with StoreServer() as server:
        raw = flight.connect(server.location)
        info = _info(_refusal(lambda: _put_group(raw, _group("bad", **columns))))
        assert info["class"] == "SchemaMismatchError" and info["column"] == column, info
        assert _stored(raw) == []
        raw.close()


def test_utc_aware_and_naive_timestamps_are_the_same_instant() -> None:
    t = dt.datetime(2026, 12, 3, 10, 0, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    with StoreServer() as server:
        raw = flight.connect(server.location)
        aware = pa.array([t] * G, pa.timestamp("us", tz="+02:00"))
        naive = pa.array([t.astimezone(dt.UTC).replace(tzinfo=None)] * G, pa.timestamp("us"))
        _put_group(raw, _group("a", created_at=aware))
        _put_group(raw, _group("n", created_at=naive))
        meta = raw.do_get(flight.Ticket(json.dumps({"v": 3, "kind": "metadata", "columns": ["created_at"]}).encode()))
        assert set(meta.read_all().column("created_at").to_pylist()) == {dt.datetime(2026, 12, 3, 8, 0)}
        raw.close()


@pytest.mark.parametrize("doc", [
    b'{"v": 3, "kind": "slices", "slices": [{"group_id": "g", "start": "0", "stop": 1}]}',
    b'{"v": 3, "kind": "slices", "slices": [{"group_id": "g", "start": true, "stop": 1}]}',
    b'{"v": 3, "kind": "metadata", "since": 1.5}',
    b'{"v": 3, "kind": "metadata", "kind": "metadata"}',
    b'{"v": "2", "kind": "metadata"}',
])
def test_tickets_take_json_numbers_only_and_no_duplicate_keys(doc: bytes) -> None:
    with StoreServer() as server:
        raw = flight.connect(server.location)
        info = _info(_refusal(lambda: raw.do_get(flight.Ticket(doc)).read_all()))
        assert info["class"] == "WireDecodeError"
        raw.close()


def test_the_clients_documents_are_the_models_bytes_and_a_bad_slice_is_refused_by_the_node() -> None:
    from flight_store import streams
    from flight_store.errors import WireDecodeError
    from schemas.plan import PlannedSlice
    from schemas.wire import SliceRef, SlicesTicket, decode_ticket

    odd = ['g"1\\', "gr\u00fcppe \u2028", "tab\tnew\nline\x01", "s0-g7"]  # quotes, escapes, non-ASCII, controls
    planned = [PlannedSlice(node="n", group_id=g, start=i, stop=i + 2) for i, g in enumerate(odd)]
    for cols in (None, ["group_id", "sample_idx"], []):
        model = SlicesTicket(slices=[SliceRef(group_id=s.group_id, start=s.start, stop=s.stop) for s in planned],
                             columns=cols)
        assert streams.slices_ticket(planned, cols) == model.to_bytes()
        assert decode_ticket(streams.slices_ticket(planned, cols)) == model
    with StoreServer() as server, StoreReader([server.location]) as client, StoreWriter.sharing(client) as writer:
        writer.put_group(_group("g"))
        with pytest.raises(WireDecodeError, match=r"empty or reversed row range \[3, 1\) for group 'g'"):
            client.fetch([PlannedSlice(node=server.location, group_id="g", start=3, stop=1)])
        assert client.fetch([PlannedSlice(node=server.location, group_id="g", start=1, stop=3)],
                            ["sample_idx"]).column("sample_idx").to_pylist() == [1, 2]


# ---- 7, 8. the client, and what the store keeps ---------------------------------------------------


def test_logprob_mode_survives_the_store_and_reaches_the_trainer() -> None:
    from schemas.plan import MicroBatch, PlannedSlice
    from train.packing import PACK_COLUMNS
    from train.trainer import fetch_micro_batch

    with StoreServer() as server:
        raw = flight.connect(server.location)
        table = _group("lp")
        _put_group(raw, table.replace_schema_metadata({b"knittrans.logprobs_mode": b"processed_logprobs"}))
        rows = raw.do_get(flight.Ticket(json.dumps({"v": 3, "kind": "slices", "slices": [
            {"group_id": "lp", "start": 0, "stop": G}]}).encode())).read_all()
        assert rows.schema.metadata[b"knittrans.logprobs_mode"] == b"processed_logprobs"
        with StoreReader(server.location) as client:
            mb = MicroBatch(slices=[PlannedSlice(node=server.location, group_id="lp", start=0, stop=G)],
                            advantages=[0.0] * G)
            got = fetch_micro_batch("padded", (client.stream([mb.slices], PACK_COLUMNS), mb))
            assert got["logprobs_mode"] == "processed_logprobs" and got["rows"] == G
            _action(raw, "release", {"v": 3, "group_ids": ["lp"]})
            assert client.scan_metadata(columns=["group_id", "released"])["released"].to_list() == [True] * G
        raw.close()


def test_images_go_to_the_groups_node_and_a_consumer_reads_admitted_micro_batches(store_nodes) -> None:
    from admission import AdmissionConfig, Planner
    from schemas.images import images_to_table

    servers = store_nodes(2)
    with StoreReader([s.location for s in servers]) as client, StoreWriter.sharing(client) as writer:
        planner = Planner(AdmissionConfig(train_batch_groups=2, group_size=G, mini_batches=1, dp_ranks=2))
        for i in range(2):
            gid = f"mm{i}"
            table, keys = images_to_table([np.full((3, 2, 2), i, np.uint8)])
            writer.put_images(table, group_ids=[gid])
            keyed = _group(gid, image_keys=pa.array([keys] * G, pa.list_(pa.binary(32))))
            writer.put_group(keyed)
            node = next(s for s in servers if s.location == client.node_for(gid))
            assert node.store.images(keys[:1], missing_ok=True).num_rows == 1 and gid in node.store.group_ids()
        (plan,) = planner.update(client.scan_new(), inflight=0)
        read = list(client.read(plan, columns=["group_id", "sample_idx", "image_keys"]))
        assert sorted(t["group_id"][0].as_py() for _, t in read) == ["mm0", "mm1"]
        assert all(t.num_rows == mb.rows for mb, t in read)
        images = client.fetch_images({k for _, t in read for ks in t.column("image_keys").to_pylist() for k in ks})
        assert images.num_rows == 2


def test_a_child_process_client_sees_the_same_routing(store_nodes) -> None:
    """Routing is a pure function of the node ids: a second process (another client) agrees."""
    servers = store_nodes(2)
    locs = [s.location for s in servers]
    code = ("import sys, json; from flight_store.client import StoreNodes;"
            "c = StoreNodes(sys.argv[1:]); print(json.dumps([c.node_for(f'g{i}') for i in range(50)]))")
    out = subprocess.run([sys.executable, "-c", code, *locs], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with StoreReader(list(reversed(locs))) as client:
        assert json.loads(out.stdout) == [client.node_for(f"g{i}") for i in range(50)]
