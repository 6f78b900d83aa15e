"""The client contract for any rollout engine: what a non-Python engine writes, with raw pyarrow.flight only.

The write path imports nothing from the project (no ``connectors``, ``flight_store`` or ``schemas``):
JSON documents, the Arrow schema and image keys are built by hand from the wire protocol (docs/protocol.md), as
an engine written in C++, Rust, Go or Java would. Only the server comes from the ``store_nodes``
fixture. Complements ``test_wire_raw.py`` (scan/fetch/release) with the engine's side: read the
published policy version, write images once by content key, write a full group (every column an
engine sets, an aborted sample included, wide Arrow types), retry a write after a "lost" answer.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight


def _cmd(doc: dict[str, object]) -> flight.FlightDescriptor:
    return flight.FlightDescriptor.for_command(json.dumps(doc).encode())


def _get(client: flight.FlightClient, doc: dict[str, object]) -> pa.Table:
    return client.do_get(flight.Ticket(json.dumps(doc).encode())).read_all()


def _action(client: flight.FlightClient, name: str, body: dict[str, object] | None = None) -> dict[str, object]:
    raw = json.dumps(body).encode() if body is not None else b""
    (result,) = list(client.do_action(flight.Action(name, raw)))
    return json.loads(result.body.to_pybytes())  # type: ignore[no-any-return]


def _put(client: flight.FlightClient, doc: dict[str, object], table: pa.Table) -> dict[str, object]:
    writer, reader = client.do_put(_cmd(doc), table.schema)
    writer.write_table(table)
    writer.done_writing()
    buf = reader.read()
    writer.close()
    return json.loads(buf.to_pybytes())  # type: ignore[no-any-return]


def _image_key(a: np.ndarray) -> bytes:
    """The protocol's key rule: sha256 over "<dtype.str>|<shape, comma-joined>|" + C-contiguous bytes."""
    a = np.ascontiguousarray(a)
    return hashlib.sha256(f"{a.dtype.str}|{','.join(map(str, a.shape))}|".encode() + a.tobytes()).digest()


# What an engine in another language would send: wide types (large_list, large_string, int64 lengths)
# that the store casts, and every column an engine knows, including timestamps and the loss mask.
ENGINE_SCHEMA = pa.schema(
    [
        ("group_id", pa.large_string()),
        ("sample_idx", pa.int64()),
        ("policy_version", pa.int64()),
        ("policy_version_min", pa.int64()),
        ("data_source", pa.large_string()),
        ("prompt_len", pa.int64()),
        ("response_len", pa.int64()),
        ("reward", pa.float32()),
        ("finish_reason", pa.string()),
        ("status", pa.string()),
        ("created_at", pa.timestamp("us")),
        ("completed_at", pa.timestamp("us")),
        ("prompt_ids", pa.large_list(pa.int32())),
        ("response_ids", pa.large_list(pa.int32())),
        ("response_logprobs", pa.large_list(pa.float32())),
        ("loss_mask", pa.large_list(pa.uint8())),
        ("image_keys", pa.list_(pa.binary(32))),
    ]
)


def test_engine_writes_a_group_with_images_using_raw_flight(store_nodes) -> None:  # type: ignore[no-untyped-def]
    (server,) = store_nodes(1)
    client = flight.connect(server.location)

    # 1. the policy version the trainer published: tag rows with it
    _action(client, "publish_version", {"v": 3, "version": 5})
    version = int(_action(client, "get_version")["version"])  # type: ignore[call-overload]
    assert version == 5

    # 2. images first, each distinct image once (the second put of the same key stores nothing)
    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, size=(3, 4, 4), dtype=np.uint8)
    key = _image_key(img)
    images = pa.table({"image_key": [key], "shape": [list(img.shape)], "dtype": ["uint8"], "data": [img.tobytes()]},
                      schema=pa.schema([("image_key", pa.binary(32)), ("shape", pa.list_(pa.int32())),
                                        ("dtype", pa.string()), ("data", pa.large_binary())]))
    assert _put(client, {"v": 3, "kind": "put_images"}, images) == {"stored": 1}
    assert _put(client, {"v": 3, "kind": "put_images"}, images) == {"stored": 0}

    # 3. the group: 3 samples, the last one aborted by the engine, every row referencing the image
    responses = [[11, 12, 13], [21, 22], [31]]
    logprobs = [np.float32(rng.normal(-2, 1, len(r))).tolist() for r in responses]
    t0, t1 = np.datetime64("2026-12-02T10:00:00", "us"), np.datetime64("2026-12-02T10:00:03", "us")
    group = pa.table(
        {
            "group_id": ["eng-1"] * 3,
            "sample_idx": [0, 1, 2],
            "policy_version": [version] * 3,
            "policy_version_min": [version - 1] * 3,
            "data_source": ["add_small"] * 3,
            "prompt_len": [4] * 3,
            "response_len": [len(r) for r in responses],
            "reward": [1.0, 0.0, 0.0],
            "finish_reason": ["stop", "length", "abort"],
            "status": ["completed", "completed", "aborted"],
            "created_at": [t0] * 3,
            "completed_at": [t1] * 3,
            "prompt_ids": [[1, 2, 3, 4]] * 3,
            "response_ids": responses,
            "response_logprobs": logprobs,
            "loss_mask": [[1] * 3, [1] * 2, [0]],
            "image_keys": [[key]] * 3,
        },
        schema=ENGINE_SCHEMA,
    )
    put = {"v": 3, "kind": "put_group", "group_id": "eng-1", "rows": 3}
    assert _put(client, put, group)["rows_added"] == 3
    # 4. the answer got lost, the engine retries: a rewrite of the same group is a no-op
    assert _put(client, put, group)["rows_added"] == 0

    # 5. read back what the trainer would see
    meta = _get(client, {"v": 3, "kind": "metadata", "since": 0,
                         "columns": ["group_id", "sample_idx", "status", "num_images", "policy_version"]})
    assert meta.num_rows == 3
    assert meta.column("status").to_pylist() == ["completed", "completed", "aborted"]
    assert meta.column("num_images").to_pylist() == [1, 1, 1]
    rows = _get(client, {"v": 3, "kind": "slices", "slices": [{"group_id": "eng-1", "start": 0, "stop": 3}],
                         "columns": ["sample_idx", "response_ids", "response_logprobs", "loss_mask", "image_keys",
                                     "created_at", "finish_reason", "policy_version_min"]})
    assert rows.column("response_ids").to_pylist() == responses
    assert rows.column("response_logprobs").to_pylist() == logprobs  # float32 in, float32 out: bit-exact
    assert rows.column("loss_mask").to_pylist() == [[1, 1, 1], [1, 1], [0]]
    assert rows.column("image_keys").to_pylist() == [[key]] * 3
    assert rows.column("finish_reason").to_pylist() == ["stop", "length", "abort"]
    assert rows.column("policy_version_min").to_pylist() == [4] * 3
    assert rows.column("created_at").to_pylist()[0] == t0.astype(object)
    got = _get(client, {"v": 3, "kind": "images", "keys": [key.hex()]})
    assert got.column("image_key").to_pylist() == [key]
    data = got.column("data")[0].as_py()
    np.testing.assert_array_equal(np.frombuffer(data, np.uint8).reshape(got.column("shape")[0].as_py()), img)
