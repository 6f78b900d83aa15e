"""Bulk writes: many groups in one DoPut per node, each validated and committed on its own, refusals named."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from flight_store.client import StoreNodes
from flight_store.errors import ConflictError, LimitExceededError, SchemaMismatchError, WireDecodeError
from flight_store.reading import StoreReader
from flight_store.writing import StoreWriter
from schemas.plan import PlannedSlice
from train.packing import PACK_COLUMNS


def _group(client: StoreNodes, gid: str, rows: int, columns: list[str] | None = None) -> pa.Table:
    with StoreReader.sharing(client) as reader:
        return reader.fetch([PlannedSlice(node=client.node_for(gid), group_id=gid, start=0, stop=rows)],
                            columns=columns)


def test_groups_land_on_their_nodes_and_read_back(store_nodes, make_group, spread_ids) -> None:  # type: ignore[no-untyped-def]
    servers = store_nodes(2)
    with StoreWriter([s.location for s in servers]) as client:
        ids = spread_ids(client, 10)
        batches = [make_group(g, size=3, response_len=5 + i) for i, g in enumerate(ids)]
        result = client.put_groups(batches)
        assert result.refused == {} and result.stored == {g: client.node_for(g) for g in ids}
        for s in servers:
            held = {g for g in ids if g in s.store.group_ids()}
            assert held == {g for g in ids if client.node_for(g) == s.location}
        for g, b in zip(ids, batches, strict=True):
            got = _group(client, g, 3, list(PACK_COLUMNS))
            assert got.equals(pa.Table.from_batches([b]).select(list(PACK_COLUMNS)))


def test_a_bad_group_is_refused_alone_and_named(store_nodes, make_group) -> None:  # type: ignore[no-untyped-def]
    (server,) = store_nodes(1)
    with StoreWriter(server.location) as client:
        client.put_group(make_group("old", size=2))
        gap = make_group("gap", size=3).set_column(1, "sample_idx", pa.array([0, 1, 5], pa.int32()))
        batches = [make_group("a", size=2), gap, make_group("old", size=2, response_len=9), make_group("b", size=2),
                   make_group("old2", size=2)]
        client.put_group(make_group("old2", size=2))
        result = client.put_groups(batches)
        assert set(result.stored) == {"a", "b", "old2"}  # an identical rewrite counts as stored
        assert isinstance(result.refused["gap"], SchemaMismatchError) and "sample_idx" in str(result.refused["gap"])
        assert isinstance(result.refused["old"], ConflictError) and not result.refused["old"].retryable
        assert "gap" not in server.store.group_ids()
        assert _group(client, "old", 2).column("response_len").to_pylist() == [8, 8]  # the first write stays


def test_client_refuses_duplicate_and_empty_batches(store_nodes, make_group) -> None:  # type: ignore[no-untyped-def]
    (server,) = store_nodes(1)
    with StoreWriter(server.location) as client:
        with pytest.raises(ValueError, match="same group"):
            client.put_groups([make_group("x"), make_group("x")])
        with pytest.raises(ValueError, match="non-empty"):
            client.put_groups([make_group("x").slice(0, 0)])
        assert server.store.stats().groups.stored == 0


def _raw_put(location: str, descriptor: dict, table: pa.Table) -> dict:  # type: ignore[type-arg]
    client = flight.connect(location)
    writer, reader = client.do_put(flight.FlightDescriptor.for_command(json.dumps(descriptor).encode()), table.schema)
    try:
        writer.write_table(table)
        writer.done_writing()
        buf = reader.read()
    finally:
        writer.close()
        client.close()
    return json.loads(buf.to_pybytes())  # type: ignore[no-any-return]


def test_rows_that_do_not_add_up_store_nothing(store_nodes, make_group) -> None:  # type: ignore[no-untyped-def]
    (server,) = store_nodes(1)
    table = pa.Table.from_batches([make_group("a", size=2), make_group("b", size=3)])
    desc = {"v": 3, "kind": "put_groups", "groups": [{"group_id": "a", "rows": 2}, {"group_id": "b", "rows": 4}]}
    with pytest.raises(flight.FlightServerError, match="declare 6 rows but the stream carried 5"):
        _raw_put(server.location, desc, table)
    desc["groups"] = [{"group_id": "a", "rows": 2}, {"group_id": "b", "rows": 3}]
    assert _raw_put(server.location, desc, table) == {"stored": {"a": 2, "b": 3}, "refused": {}}
    # rows declared for the wrong group: each slice is checked against the id it is written as
    desc["groups"] = [{"group_id": "c", "rows": 3}, {"group_id": "d", "rows": 2}]
    swapped = pa.Table.from_batches([make_group("d", size=3), make_group("c", size=2)])
    answer = _raw_put(server.location, desc, swapped)
    assert answer["stored"] == {} and set(answer["refused"]) == {"c", "d"}
    assert answer["refused"]["c"]["error"] == "SchemaMismatchError"
    assert server.store.stats().groups.stored == 2


def test_descriptor_limits(store_nodes, make_group) -> None:  # type: ignore[no-untyped-def]
    from flight_store.errors import from_flight_error

    (server,) = store_nodes(1)
    table = pa.Table.from_batches([make_group("a", size=2)])
    twice = {"v": 3, "kind": "put_groups", "groups": [{"group_id": "a", "rows": 1}, {"group_id": "a", "rows": 1}]}
    with pytest.raises(flight.FlightError) as info:
        _raw_put(server.location, twice, table)
    assert isinstance(from_flight_error(info.value), WireDecodeError) and "more than once" in str(info.value)
    many = {"v": 3, "kind": "put_groups", "groups": [{"group_id": f"g{i}", "rows": 1} for i in range(1025)]}
    with pytest.raises(flight.FlightError) as info:
        _raw_put(server.location, many, table)
    assert isinstance(from_flight_error(info.value), LimitExceededError) and "groups_per_put" in str(info.value)


def test_many_long_ids_split_into_several_doputs(store_nodes, make_group) -> None:  # type: ignore[no-untyped-def]
    (server,) = store_nodes(1)
    ids = [f"{i:04d}-" + "x" * 400 for i in range(300)]  # ~120 KB of ids: over one descriptor's 64 KiB
    with StoreWriter(server.location) as client:
        result = client.put_groups([make_group(g, size=1) for g in ids])
    assert result.refused == {} and len(result.stored) == 300
    assert server.store.stats().groups.stored == 300


def _bulk(batches: list[pa.RecordBatch]) -> tuple[pa.Table, list[tuple[str, int]]]:
    return pa.Table.from_batches(batches), [(str(b.column("group_id")[0]), b.num_rows) for b in batches]


def test_one_check_over_many_groups_keeps_every_group_rule(make_group) -> None:  # type: ignore[no-untyped-def]
    from schemas.trajectory import TrajectoryError, normalize_group, normalize_groups

    good = [make_group("a", size=2), make_group("b", size=3, response_len=5), make_group("c", size=1)]
    table, groups = _bulk(good)
    whole = normalize_groups(table, groups)
    one_by_one = pa.Table.from_batches([b for g in good for b in normalize_group([g], str(g.column(0)[0]), g.num_rows)])
    assert pa.Table.from_batches([whole]).equals(one_by_one)  # same rows, same computed bytes

    def changed(column: str, values: list[object]) -> list[pa.RecordBatch]:  # the middle group's column
        field = good[1].schema.field(column)
        return [good[0], good[1].set_column(good[1].schema.get_field_index(column), field,
                                            pa.array(values, field.type)), good[2]]

    def broken(column: str, values: list[object]) -> str:
        with pytest.raises(TrajectoryError) as info:
            normalize_groups(*_bulk(changed(column, values)))
        return str(info.value.column)

    assert broken("group_id", ["b", "a", "b"]) == "group_id"  # a row of another group, inside b's rows
    assert broken("sample_idx", [0, 0, 2]) == "sample_idx"  # repeated within one group
    assert broken("sample_idx", [0, 1, 3]) == "sample_idx"  # a gap (3 is past the group's rows)
    assert normalize_groups(*_bulk(changed("sample_idx", [2, 0, 1]))).num_rows == 6  # any order of 0..rows-1
    assert broken("reward", [0.0, float("nan"), 1.0]) == "reward"
    with pytest.raises(TrajectoryError, match="declare 7 rows"):
        normalize_groups(table, [("a", 2), ("b", 4), ("c", 1)])


def test_a_bulk_of_valid_groups_is_checked_once_not_group_by_group(store_nodes, make_group, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import flight_store.store as store_module

    def per_group(*args: object, **kwargs: object) -> None:
        raise AssertionError("a valid bulk write was checked group by group")

    (server,) = store_nodes(1)
    monkeypatch.setattr(store_module, "normalize_group", per_group)
    with StoreWriter(server.location) as client:
        batches = [make_group(f"v{i}", size=2 + i % 3) for i in range(6)]
        result = client.put_groups(batches)
        assert result.refused == {} and set(result.stored) == {f"v{i}" for i in range(6)}
        for b in batches:
            gid = str(b.column("group_id")[0])
            assert _group(client, gid, b.num_rows, list(PACK_COLUMNS)).equals(
                pa.Table.from_batches([b]).select(list(PACK_COLUMNS)))
        assert server.store.metadata().column("group_id").to_pylist() == [
            str(b.column("group_id")[0]) for b in batches for _ in range(b.num_rows)]


def test_the_write_path_bench_runs_its_three_servers_and_both_write_modes() -> None:
    from bench import write_path

    result = write_path.run(groups_n=2 * write_path.BULK, size=2, tokens=16, reps=1, seed=0)
    m, r = result["metrics"], result["ratios"]
    for key in ("put_group_gbps", "minimal_flight_put_gbps", "minimal_flight_own_pages_gbps", "put_groups_gbps",
                "minimal_flight_bulk_gbps", "server_us_per_group", "server_us_per_group_bulk"):
        assert m[key] > 0, key
    assert r["put_vs_minimal_flight"] == m["put_group_gbps"] / m["minimal_flight_put_gbps"]
    assert r["put_vs_minimal_flight_own_pages"] == m["put_group_gbps"] / m["minimal_flight_own_pages_gbps"]
    assert set(r) == {"put_vs_minimal_flight", "put_vs_minimal_flight_own_pages", "minimal_own_pages_vs_minimal_flight",
                      "put_groups_vs_minimal_flight_bulk", "put_groups_vs_put_group"}


def _with_unknown_status(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` with a ``status`` outside the schema's statuses: a rule every node refuses."""
    i = batch.schema.get_field_index("status")
    return batch.set_column(i, batch.schema.field(i), pa.array(["bogus"] * batch.num_rows, pa.string()))


def test_the_write_parts_bench_replaces_one_part_of_each_nodes_write_and_reports_every_server() -> None:
    import numpy as np

    from bench import write_parts
    from bench.store_groups import make_group

    rng = np.random.default_rng(0)
    good, other = make_group("good", 2, 16, rng), make_group("other", 2, 16, rng)
    bad = _with_unknown_status(make_group("bad", 2, 16, rng))
    nodes = {v: write_parts.start(v) for v in ("as_is", "no_store", "check_free")}
    try:
        writers = {v: StoreWriter(n.location) for v, n in nodes.items()}
        with pytest.raises(SchemaMismatchError):
            writers["as_is"].put_group(bad)
        writers["check_free"].put_group(bad)  # its check is free: the rule goes unchecked
        for w in writers.values():
            w.put_group(good)
        writers["no_store"].put_group(other)
        rows = {v: next(iter(w.stats().values())).rows for v, w in writers.items()}
        assert rows == {"as_is": 2, "no_store": 0, "check_free": 4}  # the no-store node kept nothing
        for w in writers.values():
            w.close()
    finally:
        for n in nodes.values():
            n.stop()
    with pytest.raises(ValueError, match="unknown variant"):
        write_parts.start("faster")

    result = write_parts.run(groups_n=3, size=2, tokens=16, reps=1, seed=0)
    m, r = result["metrics"], result["ratios"]
    servers = (*write_parts.VARIANTS, *write_parts.MINIMAL)
    assert all(m[f"parts_ms_per_group_{s}"] > 0 for s in servers)
    assert set(r) == {f"parts_{s}_vs_minimal" for s in servers if s != "minimal"}
    assert r["parts_as_is_vs_minimal"] == m["parts_ms_per_group_minimal"] / m["parts_ms_per_group_as_is"]
