"""A write and a read with raw pyarrow.flight calls that follow only the wire protocol (docs/protocol.md).

No import from the project here (no ``flight_store``, no ``schemas``): JSON documents and the Arrow
schema are built by hand, as a C++/Rust/Go/Java client would. The server comes from the
``store_nodes`` fixture.
"""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.flight as flight
import pytest


def _cmd(doc: dict[str, object]) -> flight.FlightDescriptor:
    return flight.FlightDescriptor.for_command(json.dumps(doc).encode())


def _ticket(doc: dict[str, object]) -> flight.Ticket:
    return flight.Ticket(json.dumps(doc).encode())


def _action(client: flight.FlightClient, name: str, body: dict[str, object] | None = None) -> dict[str, object]:
    raw = json.dumps(body).encode() if body is not None else b""
    (result,) = list(client.do_action(flight.Action(name, raw)))
    return json.loads(result.body.to_pybytes())  # type: ignore[no-any-return]


# Only the required columns; everything optional-on-write is left to the store.
WRITE_SCHEMA = pa.schema(
    [
        ("group_id", pa.string()),
        ("sample_idx", pa.int32()),
        ("policy_version", pa.int64()),
        ("prompt_len", pa.int32()),
        ("response_len", pa.int32()),
        ("reward", pa.float32()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("response_logprobs", pa.list_(pa.float32())),
    ]
)


def _group(group_id: str, size: int) -> pa.RecordBatch:
    responses = [[10 + i] * (i + 1) for i in range(size)]
    return pa.RecordBatch.from_pydict(
        {
            "group_id": [group_id] * size,
            "sample_idx": list(range(size)),
            "policy_version": [3] * size,
            "prompt_len": [2] * size,
            "response_len": [len(r) for r in responses],
            "reward": [float(i) for i in range(size)],
            "prompt_ids": [[1, 2]] * size,
            "response_ids": responses,
            "response_logprobs": [[-0.25] * len(r) for r in responses],
        },
        schema=WRITE_SCHEMA,
    )


def test_raw_flight_write_scan_fetch_release(store_nodes) -> None:
    (server,) = store_nodes(1)
    client = flight.connect(server.location)
    assert _action(client, "health")["ok"] is True

    # DoPut a prompt group (two batches in one stream)
    batch = _group("raw-1", 4)
    writer, reader = client.do_put(_cmd({"v": 3, "kind": "put_group", "group_id": "raw-1", "rows": 4}), WRITE_SCHEMA)
    writer.write_batch(batch.slice(0, 2))
    writer.write_batch(batch.slice(2, 2))
    writer.done_writing()
    answer = json.loads(reader.read().to_pybytes())
    writer.close()
    assert answer["rows_added"] == 4

    # DoGet metadata from cursor 0, projected
    meta = client.do_get(
        _ticket({"v": 3, "kind": "metadata", "since": 0, "columns": ["group_id", "sample_idx", "reward", "status"]})
    ).read_all()
    assert meta.column_names == ["seq", "group_id", "sample_idx", "reward", "status"]
    assert meta.column("seq").to_pylist() == [0, 1, 2, 3]
    assert meta.column("status").to_pylist() == ["completed"] * 4

    # DoGet slices, in ticket order
    slices = client.do_get(
        _ticket(
            {
                "v": 3,
                "kind": "slices",
                "columns": ["sample_idx", "response_ids", "loss_mask"],
                "slices": [{"group_id": "raw-1", "start": 2, "stop": 4}, {"group_id": "raw-1", "start": 0, "stop": 1}],
            }
        )
    ).read_all()
    assert slices.column("sample_idx").to_pylist() == [2, 3, 0]
    assert slices.column("response_ids").to_pylist() == [[12] * 3, [13] * 4, [10]]
    assert slices.column("loss_mask").to_pylist() == [[1] * 3, [1] * 4, [1]]

    # ListFlights describes the group; its endpoint ticket returns every row
    (info,) = list(client.list_flights())
    assert json.loads(info.descriptor.command) == {"v": 3, "kind": "group", "group_id": "raw-1"}
    assert info.total_records == 4
    assert client.do_get(info.endpoints[0].ticket).read_all().num_rows == 4

    # actions
    assert _action(client, "publish_version", {"v": 3, "version": 9}) == {"version": 9}
    assert _action(client, "get_version") == {"version": 9}
    assert _action(client, "stats")["rows"] == 4
    assert _action(client, "release", {"v": 3, "group_ids": ["raw-1"]}) == {"released": 1}

    # errors arrive as FlightError subclasses naming what was wrong
    with pytest.raises(flight.FlightServerError, match="raw-1") as exc:
        client.do_get(
            _ticket({"v": 3, "kind": "slices", "slices": [{"group_id": "raw-1", "start": 0, "stop": 1}]})
        ).read_all()
    assert exc.value.extra_info.startswith(b"knit:GroupReleasedError")
    bad = batch.drop_columns(["reward"])
    writer, _ = client.do_put(_cmd({"v": 3, "kind": "put_group", "group_id": "raw-2", "rows": 4}), bad.schema)
    with pytest.raises(flight.FlightServerError, match="reward"):
        writer.write_batch(bad)
        writer.close()
    assert _action(client, "health")["ok"] is True
    client.close()


def test_raw_images_roundtrip(store_nodes) -> None:
    (server,) = store_nodes(1)
    client = flight.connect(server.location)
    data = b"\1\2\3\4"
    key = hashlib.sha256(b"|u1|2,2|" + data).digest()  # the protocol's content key: typestr|shape| + bytes
    schema = pa.schema(
        [
            ("image_key", pa.binary(32)),
            ("shape", pa.list_(pa.int32())),
            ("dtype", pa.string()),
            ("data", pa.large_binary()),
        ]
    )
    table = pa.table({"image_key": [key], "shape": [[2, 2]], "dtype": ["uint8"], "data": [data]}, schema=schema)
    for expected in (1, 0):  # the second write stores nothing new
        writer, reader = client.do_put(_cmd({"v": 3, "kind": "put_images"}), schema)
        writer.write_table(table)
        writer.done_writing()
        assert json.loads(reader.read().to_pybytes()) == {"stored": expected}
        writer.close()
    got = client.do_get(_ticket({"v": 3, "kind": "images", "keys": [key.hex()]})).read_all()
    assert got.column("data").to_pylist() == [b"\1\2\3\4"]
    client.close()


def _answer(reader: flight.FlightStreamReader) -> tuple[pa.Table | None, dict[str, object]]:
    """One read channel answer: its rows (``None`` for a refusal) and the JSON of its last message."""
    batches = []
    while True:
        chunk = reader.read_chunk()
        if chunk.data is not None:
            batches.append(chunk.data)
        if chunk.app_metadata is not None:
            end = json.loads(chunk.app_metadata.to_pybytes())
            return (None if "error" in end else pa.Table.from_batches(batches, schema=reader.schema)), end


def test_raw_read_channel_answers_slices_tickets_one_after_another(store_nodes) -> None:
    (server,) = store_nodes(1)
    client = flight.connect(server.location)
    schema = WRITE_SCHEMA.with_metadata({"knittrans.logprobs_mode": "processed_logprobs"})
    for gid in ("raw-a", "raw-b"):
        writer, reader = client.do_put(_cmd({"v": 3, "kind": "put_group", "group_id": gid, "rows": 3}), schema)
        writer.write_batch(_group(gid, 3).replace_schema_metadata(schema.metadata))
        writer.done_writing()
        reader.read()
        writer.close()
    columns = ["group_id", "sample_idx", "response_ids"]
    writer, reader = client.do_exchange(_cmd({"v": 3, "kind": "reads", "columns": columns}))
    writer.begin(pa.schema([]))  # the client sends no rows: each request is a metadata-only message

    def ask(doc: dict[str, object]) -> tuple[pa.Table | None, dict[str, object]]:
        writer.write_metadata(json.dumps(doc).encode())
        return _answer(reader)

    def slices(*refs: tuple[str, int, int], cols: list[str] = columns) -> dict[str, object]:
        return {"v": 3, "kind": "slices", "columns": cols,
                "slices": [{"group_id": g, "start": a, "stop": b} for g, a, b in refs]}

    table, end = ask(slices(("raw-b", 1, 3), ("raw-a", 0, 1)))
    assert table is not None and table.column_names == columns
    assert list(zip(table["group_id"].to_pylist(), table["sample_idx"].to_pylist(), strict=True)) == [
        ("raw-b", 1), ("raw-b", 2), ("raw-a", 0)]
    assert end["rows"] == 3 and end["metadata"]["knittrans.logprobs_mode"] == "processed_logprobs"  # type: ignore[index]
    # refusals are answered in band, naming what was wrong, and the channel goes on
    for doc, error, named in [
        (slices(("nope", 0, 1)), "UnknownGroupError", "nope"),
        (slices(("raw-a", 0, 1), cols=["sample_idx"]), "SchemaMismatchError", "columns"),
        ({"v": 3, "kind": "metadata", "since": 0}, "WireDecodeError", "slices tickets"),
        ({"v": 3, "kind": "slices", "slices": []}, "WireDecodeError", "slices"),
    ]:
        refused, end = ask(doc)
        assert refused is None and end["error"]["error"] == error, end  # type: ignore[index]
        assert named in end["error"]["message"]  # type: ignore[index]
    table, end = ask(slices(("raw-a", 2, 3)))
    assert table is not None and table["response_ids"].to_pylist() == [[12] * 3] and end["rows"] == 1
    writer.done_writing()  # the client ends the channel
    with pytest.raises(StopIteration):
        reader.read_chunk()
    writer.close()
    # a descriptor of another kind, or naming an unknown column, is refused when the channel opens
    for doc, named in [({"v": 3, "kind": "put_images"}, "reads"), ({"v": 3, "kind": "reads", "columns": ["x"]}, "'x'")]:
        writer, reader = client.do_exchange(_cmd(doc))
        with pytest.raises(flight.FlightServerError, match=named):
            writer.begin(pa.schema([]))
            writer.write_metadata(json.dumps(slices(("raw-a", 0, 1))).encode())
            reader.read_chunk()
    client.close()
