"""StoreServer over real gRPC on port 0: RPCs, error mapping (typed, server keeps serving), CLI."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from flight_store.client import StoreAdmin
from flight_store.config import ServerConfig, StoreConfig
from flight_store.errors import (
    BudgetExceededError,
    SchemaMismatchError,
    UnknownGroupError,
    UnknownImageError,
    WireDecodeError,
)
from flight_store.publishing import StorePublisher
from flight_store.reading import StoreReader
from flight_store.writing import StoreWriter
from schemas.plan import PlannedSlice
from schemas.replies import ACTION_DESCRIPTIONS, GroupCounts, PutGroupReply
from schemas.wire import GroupRef, MetadataTicket, PutGroup


def _still_serves(client: StoreReader, make_group, gid: str = "alive") -> None:
    """After an error, the node still answers and still stores and serves."""
    with StoreAdmin.sharing(client) as admin, StoreWriter.sharing(client) as writer:
        assert all(h.ok for h in admin.health().values())
        node = writer.put_group(make_group(gid, size=2))
    assert client.fetch([PlannedSlice(node=node, group_id=gid, start=0, stop=2)]).num_rows == 2


def test_schema_mismatch_names_column_stores_nothing(store_nodes, make_group) -> None:
    (server,) = store_nodes(1)
    with StoreReader(server.location) as client, StoreWriter.sharing(client) as writer:
        bad = make_group("g", size=3).drop_columns(["response_logprobs"])
        with pytest.raises(SchemaMismatchError, match="'response_logprobs'") as exc:
            writer.put_group(bad)
        assert exc.value.column == "response_logprobs"
        assert isinstance(exc.value, flight.FlightServerError)
        assert client.scan_metadata().height == 0 and server.store.group_ids() == []
        _still_serves(client, make_group)


def test_raw_client_sees_a_flight_error_naming_the_column(store_nodes, make_group) -> None:
    (server,) = store_nodes(1)
    raw = flight.connect(server.location)
    batch = make_group("g", size=2)
    bad = batch.set_column(batch.schema.get_field_index("reward"), "reward", pa.array(["x", "y"]))
    writer, _ = raw.do_put(flight.FlightDescriptor.for_command(PutGroup(group_id="g", rows=2).to_bytes()), bad.schema)
    with pytest.raises(flight.FlightServerError, match="'reward'") as exc:
        writer.write_batch(bad)
        writer.close()
    assert exc.value.extra_info.startswith(b"knit:SchemaMismatchError")
    raw.close()


@pytest.mark.parametrize(
    "raw_ticket",
    [
        b"{not json",
        b'{"v": 99, "kind": "metadata"}',
        b'{"kind": "metadata"}',
        b'{"v": 3, "kind": "nope"}',
        b'{"v": 3, "kind": "slices", "slices": []}',
    ],
)
def test_malformed_ticket_is_a_wire_error(store_nodes, make_group, raw_ticket: bytes) -> None:
    (server,) = store_nodes(1)
    with StoreReader(server.location) as client:
        with pytest.raises(WireDecodeError):
            client._calls.get(server.location, raw_ticket)
        _still_serves(client, make_group)


@pytest.mark.parametrize(
    "raw_descriptor",
    [b"[1, 2]", b'{"v": 3, "kind": "put_group", "group_id": "g"}', b'{"v": 3, "kind": "put_group"}'],
)
def test_malformed_descriptor_is_a_wire_error(store_nodes, make_group, raw_descriptor: bytes) -> None:
    (server,) = store_nodes(1)
    with StoreReader(server.location) as client:
        with pytest.raises(WireDecodeError, match="descriptor"):
            client._calls.put(server.location, raw_descriptor, pa.Table.from_batches([make_group("g")]), PutGroupReply)
        assert server.store.group_ids() == []
        _still_serves(client, make_group)


def test_unknown_version_message_names_the_version(store_nodes) -> None:
    (server,) = store_nodes(1)
    raw = flight.connect(server.location)
    with pytest.raises(flight.FlightServerError, match="v=7"):
        raw.do_get(flight.Ticket(b'{"v": 7, "kind": "metadata"}')).read_all()
    with pytest.raises(flight.FlightServerError, match="release"):
        list(raw.do_action(flight.Action("release", b"{oops")))
    raw.close()


def test_unknown_group_and_image(store_nodes, make_group) -> None:
    (server,) = store_nodes(1)
    with StoreReader(server.location) as client:
        with pytest.raises(UnknownGroupError, match="'ghost'") as exc:
            client.fetch([PlannedSlice(node=server.location, group_id="ghost", start=0, stop=1)])
        assert exc.value.group_id == "ghost"
        key = bytes(range(32))
        with pytest.raises(UnknownImageError, match=key.hex()) as iexc:
            client.fetch_images([key])
        assert iexc.value.key == key.hex()
        _still_serves(client, make_group)


def test_budget_exceeded_is_retryable_and_unavailable(store_nodes, make_group) -> None:
    (server,) = store_nodes(1, ServerConfig(store=StoreConfig(memory_budget=70_000)))  # one ~53 kB group fits
    with StoreReader(server.location) as client, StoreWriter.sharing(client) as writer:
        writer.put_group(make_group("a", size=4, response_len=1000))
        with pytest.raises(BudgetExceededError) as exc:
            writer.put_group(make_group("b", size=4, response_len=1000))
        assert exc.value.retryable and isinstance(exc.value, flight.FlightUnavailableError)
        assert server.store.group_ids() == ["a"]
        assert client.release(["a"]) == {server.location: 1}
        writer.put_group(make_group("b", size=4, response_len=1000))  # the retry succeeds
        assert server.store.group_ids() == ["b"]
        _still_serves(client, make_group)


def test_a_call_while_the_node_is_starting_is_refused_retryably_then_served(make_group, monkeypatch) -> None:
    """The node listens before its store is built (a restarted node replays its spill log meanwhile, and its
    clients are calling): those calls get a retryable refusal, never an internal error, and a client's retries
    reach the node once it is up."""
    import threading
    import time

    from flight_store import server as server_module
    from flight_store.net import free_port
    from flight_store.server import StoreServer

    building = threading.Event()
    real_store = server_module.Store

    def slow_store(*args, **kwargs):  # type: ignore[no-untyped-def]
        building.set()
        time.sleep(0.5)  # a spill log being replayed
        return real_store(*args, **kwargs)

    monkeypatch.setattr(server_module, "Store", slow_store)
    port = free_port()
    started: list[StoreServer] = []
    starter = threading.Thread(target=lambda: started.append(StoreServer(ServerConfig(port=port))))
    starter.start()
    try:
        assert building.wait(10)
        location = f"grpc://127.0.0.1:{port}"
        raw = flight.connect(location)
        refusals = []
        group = flight.FlightDescriptor.for_command(GroupRef(group_id="g").to_bytes())
        for call in (lambda: list(raw.do_action(flight.Action("health", b""))),
                     lambda: raw.do_get(flight.Ticket(MetadataTicket().to_bytes())).read_all(),
                     lambda: raw.get_flight_info(group)):
            with pytest.raises(flight.FlightUnavailableError, match="the node is starting") as exc:
                call()
            refusals.append(exc.value)
        raw.close()
        assert len(refusals) == 3
        # retried until the node is up
        with StoreWriter(location, retries=8, backoff=0.05) as client, StoreAdmin.sharing(client) as admin:
            client.put_group(make_group("g", size=2))
            assert admin.health()[location].ok
    finally:
        starter.join(10)
        for s in started:
            s.shutdown()


def test_duplicate_write_keeps_one_copy(store_nodes, make_group) -> None:
    (server,) = store_nodes(1)
    with StoreReader(server.location) as client, StoreWriter.sharing(client) as writer:
        for _ in range(3):
            writer.put_group(make_group("g", size=4))
        meta = client.scan_metadata(columns=["group_id", "sample_idx"])
        assert meta.height == 4 and meta["sample_idx"].to_list() == [0, 1, 2, 3]
        _still_serves(client, make_group)


def test_actions_list_and_answers(store_nodes, make_group) -> None:
    (server,) = store_nodes(1, ServerConfig(store=StoreConfig(memory_budget=1 << 30)))
    raw = flight.connect(server.location)
    described = {a.type: a.description for a in raw.list_actions()}
    assert described == ACTION_DESCRIPTIONS
    with StoreReader(server.location) as client, StoreWriter.sharing(client) as writer, \
            StorePublisher.sharing(client) as publisher:
        writer.put_group(make_group("g", size=3))
        stats = client.stats()[server.location]
        assert stats.rows == 3 and stats.groups == GroupCounts(stored=1, released=0, inflight=0)
        assert stats.memory_budget == 1 << 30 and stats.memory_used > 0
        publisher.publish_version(4)
        assert json.loads(next(iter(raw.do_action(flight.Action("get_version", b"")))).body.to_pybytes()) == {
            "version": 4
        }
    raw.close()


def test_list_flights_and_get_flight_info_describe_groups(store_nodes, make_group) -> None:
    (server,) = store_nodes(1)
    with StoreReader(server.location) as client, StoreWriter.sharing(client) as writer:
        writer.put_group(make_group("a", size=2))
        writer.put_group(pa.Table.from_batches([make_group("b", size=1, start=3), make_group("b", size=3)]))
        client.release(["a"])
    raw = flight.connect(server.location)
    infos = list(raw.list_flights())
    assert [json.loads(i.descriptor.command) for i in infos] == [{"v": 3, "kind": "group", "group_id": "b"}]
    info = raw.get_flight_info(flight.FlightDescriptor.for_command(GroupRef(group_id="b").to_bytes()))
    assert info.total_records == 4 and info.total_bytes > 0
    table = raw.do_get(info.endpoints[0].ticket).read_all()
    assert table.column("sample_idx").to_pylist() == [0, 1, 2, 3]
    with pytest.raises(flight.FlightServerError, match="'zzz'"):
        raw.get_flight_info(flight.FlightDescriptor.for_command(GroupRef(group_id="zzz").to_bytes()))
    raw.close()


def test_doget_slices_projection_and_order(store_nodes, make_group) -> None:
    (server,) = store_nodes(1)
    with StoreReader(server.location) as client, StoreWriter.sharing(client) as writer:
        for g in "abc":
            writer.put_group(make_group(g, size=4))
        loc = server.location
        slices = [PlannedSlice(node=loc, group_id=g, start=s, stop=e) for g, s, e in [("c", 2, 4), ("a", 0, 1)]]
        table = client.fetch(slices, columns=["sample_idx", "group_id", "response_ids"])
        assert table.column_names == ["sample_idx", "group_id", "response_ids"]
        assert list(zip(table["group_id"].to_pylist(), table["sample_idx"].to_pylist(), strict=True)) == [
            ("c", 2),
            ("c", 3),
            ("a", 0),
        ]
        meta = client._calls.get(loc, MetadataTicket(since=4, columns=["group_id"]).to_bytes())
        assert meta.column_names == ["seq", "group_id"] and meta["group_id"].to_pylist() == ["b"] * 4 + ["c"] * 4


def test_node_process_runs_a_config_document(node_process) -> None:
    proc, location = node_process(ServerConfig(store=StoreConfig(memory_budget=1_000_000)))
    assert location.startswith("grpc://127.0.0.1:")
    with StoreAdmin(location, timeout=10) as client:
        assert client.health()[location].ok
        assert client.stats()[location].memory_budget == 1_000_000
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert proc.stdout is not None and proc.stdout.read().strip().endswith("knit serve: stopped")


def test_node_process_refuses_a_bad_config_document(tmp_path) -> None:
    path = tmp_path / "node.json"
    path.write_text('{"port": 70000}', encoding="utf-8")
    res = subprocess.run([sys.executable, "-m", "flight_store", "--config", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "port must be in 0..65535" in res.stderr and res.stdout == ""


def test_server_config_checks_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"coalesce_below .* -1"):
        ServerConfig(coalesce_below=-1)
    with pytest.raises(ValueError, match=r"metrics_port .* 65536"):
        ServerConfig(metrics_port=65536)
    with pytest.raises(ValueError, match=r"log_level .* 'LOUD'"):
        ServerConfig(log_level="LOUD")
    with pytest.raises(ValueError, match=r"memory_budget .* -5"):
        StoreConfig(memory_budget=-5)
    assert ServerConfig(tls_cert_file="c.pem", tls_key_file="k.pem", port=9).location == "grpc+tls://127.0.0.1:9"
