"""The node-local Store, without gRPC: index slicing, idempotency, validation, budget, images, weights."""

from __future__ import annotations

import gc
import mmap
import os
import threading
import weakref

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flight_store import metadata
from flight_store.blocks import pack
from flight_store.config import StoreConfig
from flight_store.errors import (
    BudgetExceededError,
    ConflictError,
    GroupReleasedError,
    KnitError,
    SchemaMismatchError,
    UnknownGroupError,
    UnknownImageError,
    UnknownWeightsError,
)
from flight_store.store import Store
from flight_store.validate import normalize_group
from schemas.arrow import METADATA_SCHEMA, TRAJECTORY_SCHEMA
from schemas.images import images_to_table


def _rows(batches: list[pa.RecordBatch], col: str = "sample_idx") -> list[object]:
    return pa.Table.from_batches(batches).column(col).to_pylist() if batches else []


# ---- slicing -----------------------------------------------------------------------------------


def test_slices_are_zero_copy_views_of_the_stored_batch(make_group) -> None:
    store = Store()
    store.put_group("g", [make_group("g", size=8)])
    (stored,) = store._contents.groups["g"].batches
    out = store.slices([("g", 2, 6)])
    assert len(out) == 1 and out[0].num_rows == 4
    assert _rows(out) == [2, 3, 4, 5]
    # same buffers as the stored batch: a view, not a copy
    got = out[0].column("response_ids").buffers()
    want = stored.column("response_ids").buffers()
    assert [b.address for b in got if b is not None] == [b.address for b in want if b is not None]


def test_bytes_out_counts_the_projected_rows_and_adds_up_over_any_split(make_group) -> None:
    store = Store()
    batch = make_group("g", size=8, response_len=10)
    store.put_group("g", [batch])

    def served(refs: list[tuple[str, int, int]], columns: list[str] | None = None) -> int:
        before = store.bytes_out
        store.slices(refs, columns)
        return store.bytes_out - before

    whole = served([("g", 0, 8)])
    assert whole == sum(served([("g", a, a + 1)]) for a in range(8)) == served([("g", 0, 3), ("g", 3, 8)])
    assert whole == batch.nbytes
    assert served([("g", 2, 5)], ["sample_idx", "reward"]) == 3 * (4 + 4)
    assert served([("g", 0, 2)], ["response_ids"]) == 2 * (4 + 10 * 4)  # offset + 10 int32 tokens per row


def test_slices_follow_request_order_across_the_batches_of_a_group(make_group) -> None:
    store = Store()
    assert store.put_group("g", [make_group("g", size=2, start=2), make_group("g", size=2)]) == 4  # 2 batches
    store.put_group("h", [make_group("h", size=3)])
    out = store.slices([("h", 1, 3), ("g", 1, 4), ("h", 0, 1)], columns=["group_id", "sample_idx"])
    assert list(zip(_rows(out, "group_id"), _rows(out), strict=True)) == [
        ("h", 1),
        ("h", 2),
        ("g", 1),
        ("g", 2),
        ("g", 3),
        ("h", 0),
    ]
    assert out[0].schema.names == ["group_id", "sample_idx"]
    # g's rows [1, 4) live in two stored batches: two zero-copy slices, no concatenation
    assert [b.num_rows for b in out] == [2, 1, 2, 1]
    store.put_group("r", [make_group("r", size=3).take([2, 0, 1])])  # one batch, rows not in sample_idx order
    out = store.slices([("r", 0, 3)], columns=["sample_idx", "reward"])
    assert _rows(out) == [0, 1, 2] and _rows(out, "reward") == [0.0, 1.0, 0.0]
    assert [b.num_rows for b in out] == [2, 1]  # rows 0 and 1 lie together (offsets 1-2), row 2 first
    with pytest.raises(SchemaMismatchError, match="declares 5 rows but its stream carried 4"):
        store.put_group("k", [make_group("k", size=4)], rows=5)
    assert "k" not in store.group_ids()


def test_slice_errors_name_the_group(make_group) -> None:
    store = Store()
    store.put_group("g", [make_group("g", size=2)])
    with pytest.raises(UnknownGroupError, match="'nope'") as exc:
        store.slices([("nope", 0, 1)])
    assert exc.value.group_id == "nope"
    with pytest.raises(UnknownGroupError, match="sample_idx=2"):
        store.slices([("g", 0, 3)])
    with pytest.raises(SchemaMismatchError, match="'bogus'") as sm:
        store.slices([("g", 0, 1)], columns=["bogus"])
    assert sm.value.column == "bogus"


def test_a_batch_of_exactly_the_schema_is_still_refused_for_nulls_and_broken_rules(make_group) -> None:
    store = Store()
    good = make_group("g", size=2)
    assert good.schema.equals(TRAJECTORY_SCHEMA)  # the writer's schema: the checks of names and types are skipped
    bad = {  # column -> an array of its type breaking a rule, under the schema's own (non-nullable) field
        "reward": pa.array([1.0, None], pa.float32()),
        "response_ids": pa.array([[1] * 8, [1] * 7 + [None]], pa.list_(pa.int32())),
        "response_len": pa.array([8, 9], pa.int32()),
    }
    for name, array in bad.items():
        cols = [array if f.name == name else good.column(i) for i, f in enumerate(TRAJECTORY_SCHEMA)]
        batch = pa.RecordBatch.from_arrays(cols, schema=TRAJECTORY_SCHEMA)
        assert batch.schema.equals(TRAJECTORY_SCHEMA)
        with pytest.raises(SchemaMismatchError) as exc:
            store.put_group("g", [batch])
        assert exc.value.column == name, (name, exc.value)
    assert store.group_ids() == []
    assert store.put_group("g", [good]) == 2


def test_read_views_are_kept_for_the_next_reads_bounded_and_dropped_with_their_group(make_group, monkeypatch) -> None:
    from flight_store import groups

    monkeypatch.setattr(groups, "VIEWS_KEPT", 3)
    made: list[int] = []
    real = groups.Group.batch
    monkeypatch.setattr(groups.Group, "batch", lambda self, i: made.append(i) or real(self, i))
    store = Store()
    for g in "abcd":
        store.put_group(g, [make_group(g, size=4)])
    kept = store._contents.groups._views
    cols = ["group_id", "sample_idx"]
    # a micro-batch per slice, as ranks read a group: one view of the stored batch for all of them
    got = [store.slices([("a", k, k + 1)], cols) for k in range(4)]
    assert [_rows(b) for b in got] == [[0], [1], [2], [3]] and len(made) == 1
    assert _rows(store.slices([("a", 1, 3)], ["sample_idx"])) == [1, 2] and len(made) == 2  # another projection
    assert store.slices([("a", 0, 1)])[0].schema.names == TRAJECTORY_SCHEMA.names and len(made) == 3
    store.slices([("b", 0, 1)], cols)  # a fourth view: the least recently read of a's goes
    assert len(made) == 4 and len(kept) == 3
    assert [k[0] for k in kept] == ["a", "a", "b"]
    store.slices([("a", 0, 4)], cols)  # dropped first: made again
    assert len(made) == 5 and len(kept) == 3
    assert store.release(["a"]) == 1
    assert [k[0] for k in kept] == ["b"]  # a released group's views go at once (they keep its blocks mapped)
    with pytest.raises(GroupReleasedError, match="'a'"):
        store.slices([("a", 0, 1)], cols)


# ---- idempotency -------------------------------------------------------------------------------


def test_a_rewrite_is_idempotent_with_the_same_content_and_refused_with_other(make_group) -> None:
    store = Store()
    assert store.put_group("g", [make_group("g", size=4)]) == 4
    assert store.put_group("g", [make_group("g", size=4)]) == 0  # a retry: same content (timestamps aside)
    with pytest.raises(ConflictError, match="column 'data_source' differs") as exc:
        store.put_group("g", [make_group("g", size=4, data_source="other")])
    assert exc.value.column == "data_source" and exc.value.group_id == "g" and not exc.value.retryable
    with pytest.raises(ConflictError, match="4 rows; the rewrite has 2"):
        store.put_group("g", [make_group("g", size=2)])
    with pytest.raises(SchemaMismatchError, match=r"must hold 0\.\.3 once each; 0 is missing"):
        store.put_group("h", [make_group("h", size=4, start=2)])  # a gap (no row 0, 1): never a partial group
    meta = store.metadata()
    assert sorted(meta.column("sample_idx").to_pylist()) == [0, 1, 2, 3]
    assert _rows(store.slices([("g", 0, 4)])) == [0, 1, 2, 3]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4), st.integers(0, 1)), min_size=1, max_size=12))
def test_any_write_sequence_stores_each_group_exactly_once(writes: list[tuple[int, int, int]]) -> None:
    from schemas.records import TrajectoryRecord, records_to_batch

    store = Store()
    first: dict[str, tuple[int, int]] = {}
    for g, size, token in writes:
        gid = f"g{g}"
        batch = records_to_batch([TrajectoryRecord(group_id=gid, sample_idx=i, policy_version=0, prompt_ids=[1],
                                                   response_ids=[token], response_logprobs=[0.0])
                                  for i in range(size)])
        if gid not in first:
            assert store.put_group(gid, [batch]) == size
            first[gid] = (size, token)
        elif first[gid] == (size, token):
            assert store.put_group(gid, [batch]) == 0
        else:
            with pytest.raises(ConflictError):
                store.put_group(gid, [batch])
    meta = store.metadata()
    assert meta.column("seq").to_pylist() == list(range(meta.num_rows))
    got = sorted(zip(meta.column("group_id").to_pylist(), meta.column("sample_idx").to_pylist(), strict=True))
    assert got == sorted((g, s) for g, (size, _) in first.items() for s in range(size))
    for gid, (size, token) in first.items():
        for s in range(size):  # every row is served, and it is the row that was written first
            (b,) = store.slices([(gid, s, s + 1)], columns=["response_ids"])
            assert b.column(0).to_pylist() == [[token]]


# ---- metadata ----------------------------------------------------------------------------------


def test_metadata_cursor_and_projection(make_group) -> None:
    store = Store()
    store.put_group("a", [make_group("a", size=3)])
    store.put_group("b", [make_group("b", size=2)])
    full = store.metadata()
    assert full.schema.equals(METADATA_SCHEMA, check_metadata=False)
    assert full.column("seq").to_pylist() == [0, 1, 2, 3, 4]
    tail = store.metadata(since=3, columns=["reward", "group_id", "seq"])
    assert tail.column_names == ["seq", "reward", "group_id"]
    assert tail.column("group_id").to_pylist() == ["b", "b"]
    assert store.metadata(since=99).num_rows == 0
    with pytest.raises(SchemaMismatchError, match="'response_ids'"):
        store.metadata(columns=["response_ids"])  # payload is never in the metadata log


def test_metadata_survives_compaction_and_release(make_group) -> None:
    store = Store()
    for i in range(300):  # more than the compaction threshold
        store.put_group(f"g{i}", [make_group(f"g{i}", size=2)])
    assert store.release([f"g{i}" for i in range(300)]) == 300
    meta = store.metadata(since=590)
    assert meta.column("seq").to_pylist() == list(range(590, 600))
    assert meta.column("group_id").to_pylist()[-1] == "g299"
    assert store.stats().memory_used == 0


def _blocks(make_group, n: int, rows: int) -> list[mmap.mmap]:  # type: ignore[no-untyped-def]
    """``n`` packed groups of ``rows`` rows, each large enough for pages of its own."""
    out = [pack(normalize_group([make_group(f"g{i}", size=rows, response_len=2000)], f"g{i}", rows)[0])[0]
           for i in range(n)]
    assert all(isinstance(b, mmap.mmap) for b in out)
    return out  # type: ignore[return-value]


def test_the_metadata_log_copies_its_rows_out_of_the_blocks_and_keeps_none(make_group) -> None:
    log = metadata.MetadataLog()
    blocks = _blocks(make_group, 3, 3)
    assert [log.append([b], 3) for b in blocks] == [0, 3, 6]
    assert log.append([blocks[0]], 3, seq=20) == 20  # a restored group keeps its numbers
    assert (log.rows, log.seq) == (12, 23)
    refs = [weakref.ref(b) for b in blocks]
    table = log.table()
    del blocks
    gc.collect()
    assert [r() for r in refs] == [None, None, None]  # the rows are the log's own copies
    assert table.column("seq").to_pylist() == [*range(9), 20, 21, 22]
    assert table.column("group_id").to_pylist() == ["g0"] * 3 + ["g1"] * 3 + ["g2"] * 3 + ["g0"] * 3


def test_metadata_rows_wait_in_the_blocks_only_up_to_a_bound(make_group, monkeypatch) -> None:
    monkeypatch.setattr(metadata, "SETTLE_AT", 2)
    log = metadata.MetadataLog()
    blocks = _blocks(make_group, 3, 2)
    refs = [weakref.ref(b) for b in blocks]
    for b in blocks[:2]:
        log.append([b], 2)
    del b
    log.append([blocks.pop()], 2)  # 3 groups wait: more than the bound, so all are copied, none read
    del blocks
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    assert log.table().column("sample_idx").to_pylist() == [0, 1] * 3


def test_release_frees_payload_and_keeps_history(make_group) -> None:
    store = Store()
    store.put_group("g", [make_group("g", size=4, response_len=1000)])
    used = store.stats().memory_used
    assert isinstance(used, int) and used > 4 * 4000
    block = weakref.ref(store._contents.groups["g"].blocks[0])
    assert store.release(["g", "unknown"]) == 1
    gc.collect()
    assert block() is None  # unmapped at once: the metadata log copied its rows out first
    assert store.release(["g"]) == 0  # already released
    assert store.stats().memory_used == 0
    assert store.metadata().num_rows == 4
    with pytest.raises(GroupReleasedError, match="'g'") as exc:
        store.slices([("g", 0, 1)])
    assert exc.value.group_id == "g"
    # a retried write of the same rows is still a no-op; other content for a consumed group is refused
    assert store.put_group("g", [make_group("g", size=4, response_len=1000)]) == 0
    with pytest.raises(ConflictError, match="was consumed with other content: column 'response_len'"):
        store.put_group("g", [make_group("g", size=4)])
    assert store.metadata().column("released").to_pylist() == [True] * 4


# ---- validation --------------------------------------------------------------------------------


def _replace(batch: pa.RecordBatch, name: str, arr: pa.Array) -> pa.RecordBatch:
    i = batch.schema.get_field_index(name)
    return batch.set_column(i, pa.field(name, arr.type), arr)


@pytest.mark.parametrize(
    ("column", "mutate"),
    [
        ("reward", lambda b: b.drop_columns(["reward"])),
        ("reward", lambda b: _replace(b, "reward", pa.array(["x"] * b.num_rows))),
        ("reward", lambda b: _replace(b, "reward", pa.array([None] + [1.0] * (b.num_rows - 1), pa.float32()))),
        ("extra", lambda b: b.append_column("extra", pa.array([1] * b.num_rows))),
        ("group_id", lambda b: _replace(b, "group_id", pa.array(["other"] * b.num_rows))),
        ("status", lambda b: _replace(b, "status", pa.array(["running"] * b.num_rows))),
        (
            "response_logprobs",
            lambda b: _replace(b, "response_logprobs", pa.array([[0.0]] * b.num_rows, pa.list_(pa.float32()))),
        ),
        ("loss_mask", lambda b: _replace(b, "loss_mask", pa.array([[1]] * b.num_rows, pa.list_(pa.uint8())))),
        ("prompt_len", lambda b: _replace(b, "prompt_len", pa.array([99] * b.num_rows, pa.int32()))),
        ("sample_idx", lambda b: _replace(b, "sample_idx", pa.array([0] * b.num_rows, pa.int32()))),
        ("sample_idx", lambda b: _replace(b, "sample_idx", pa.array([2**40] * b.num_rows, pa.int64()))),
        ("response_ids", lambda b: _replace(b, "response_ids", pa.array([[1.5]] * b.num_rows))),
    ],
)
def test_mismatch_names_the_column_and_stores_nothing(make_group, column: str, mutate) -> None:
    store = Store()
    good = make_group("g", size=3)
    with pytest.raises(SchemaMismatchError, match=repr(column)) as exc:
        store.put_group("g", [make_group("g", size=1, start=5), mutate(good)])  # the first batch is fine
    assert exc.value.column == column
    assert store.metadata().num_rows == 0 and store.group_ids() == []
    assert store.stats().memory_used == 0


def test_repeated_sample_idx_across_batches_of_one_stream_is_refused(make_group) -> None:
    store = Store()
    with pytest.raises(SchemaMismatchError, match="sample_idx"):
        store.put_group("g", [make_group("g", size=2), make_group("g", size=2, start=1)])
    assert store.metadata().num_rows == 0


def test_optional_columns_are_filled(make_group) -> None:
    from flight_store.validate import normalize_batch

    full = make_group("g", size=2)
    minimal = full.select(
        [
            "group_id",
            "sample_idx",
            "policy_version",
            "prompt_len",
            "response_len",
            "reward",
            "prompt_ids",
            "response_ids",
            "response_logprobs",
        ]
    )
    store = Store()
    store.put_group("g", [minimal])
    (row, _) = store.slices([("g", 0, 2)])[0].to_pylist()
    assert row["policy_version_min"] == row["policy_version"] == 0
    assert row["num_images"] == 0 and row["image_keys"] == []
    assert row["loss_mask"] == [1] * len(row["response_ids"])
    assert row["token_versions"] == [row["policy_version"]] * len(row["response_ids"])
    assert (row["finish_reason"], row["status"], row["data_source"]) == ("stop", "completed", "default")
    assert row["created_at"] is not None and row["completed_at"] is not None
    # bytes is always recomputed: 4-byte offsets + values of every payload list
    n_resp = len(row["response_ids"])
    assert row["bytes"] == (4 + 4 * 4) + 2 * (4 + 4 * n_resp) + (4 + n_resp) + 4 + (4 + 4 * n_resp)
    lied = _replace(full, "bytes", pa.array([999, 999], pa.int64()))
    assert normalize_batch(lied, "g").column("bytes").to_pylist() == [row["bytes"]] * 2


def test_safe_casts_are_accepted(make_group) -> None:
    b = make_group("g", size=2)
    b = _replace(b, "sample_idx", pa.array([0, 1], pa.int64()))
    b = _replace(b, "data_source", pa.array(["math", "math"]).dictionary_encode())
    b = _replace(b, "finish_reason", pa.array(["stop", "length"], pa.large_string()))
    b = _replace(b, "response_ids", b.column("response_ids").cast(pa.large_list(pa.int64())))
    b = _replace(b, "loss_mask", b.column("loss_mask").cast(pa.list_(pa.bool_())))
    store = Store()
    assert store.put_group("g", [b]) == 2
    (out,) = store.slices([("g", 0, 2)])
    assert out.schema.equals(TRAJECTORY_SCHEMA, check_metadata=False)
    assert out.column("data_source").to_pylist() == ["math", "math"]


# ---- budget ------------------------------------------------------------------------------------


def test_budget_refuses_retryably_and_never_drops(make_group) -> None:
    store = Store(StoreConfig(memory_budget=70_000))  # one group of ~53 kB fits, two do not
    store.put_group("a", [make_group("a", size=4, response_len=1000)])
    with pytest.raises(BudgetExceededError, match="memory budget") as exc:
        store.put_group("b", [make_group("b", size=4, response_len=1000)])
    assert exc.value.retryable and isinstance(exc.value, KnitError)
    assert store.group_ids() == ["a"] and store.metadata().num_rows == 4
    store.release(["a"])
    assert store.put_group("b", [make_group("b", size=4, response_len=1000)]) == 4



@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="the RSS guard reads /proc/self/statm")
def test_rss_guard_refuses_while_the_process_outgrows_the_budget(make_group) -> None:
    budget = 16 << 20
    store = Store(StoreConfig(memory_budget=budget, rss_guard=True))
    assert store.put_group("a", [make_group("a", size=2)]) == 2  # counted use is tiny
    ballast = np.ones(3 * budget // 8, dtype=np.int64)  # 48 MiB resident that no count sees
    s = store.stats()
    assert s.memory_rss is not None and s.memory_rss_limit is not None
    assert s.memory_rss > s.memory_rss_limit and s.memory_used < budget // 100
    with pytest.raises(BudgetExceededError, match="resident memory") as exc:
        store.put_group("b", [make_group("b", size=2)])
    assert exc.value.retryable
    assert store.group_ids() == ["a"]
    store.release(["a"])
    assert store.put_group("b", [make_group("b", size=2)]) == 2  # an empty store always takes one write
    del ballast
    assert store.put_group("c", [make_group("c", size=2)]) == 2  # the memory went back: writes flow again
    assert store.group_ids() == ["b", "c"]
    store.close()
    assert Store(StoreConfig(memory_budget=budget)).stats().memory_rss is None  # off unless asked for


def test_the_heap_is_trimmed_after_writes_and_releases_only_under_a_budget(make_group, monkeypatch) -> None:
    from flight_store import memory

    trims: list[int] = []
    monkeypatch.setattr(memory, "_malloc_trim", lambda pad: trims.append(pad) or 1)
    monkeypatch.setattr(memory, "_TRIM_EVERY_S", 0.0)  # every call may trim
    for budget, trimmed in ((None, False), (64 << 20, True)):
        trims.clear()
        store = Store(StoreConfig(memory_budget=budget))
        assert store.put_group("a", [make_group("a", size=2)]) == 2
        after_write = len(trims)
        assert store.release(["a"]) == 1
        assert (after_write > 0, len(trims) > after_write) == (trimmed, trimmed), (budget, trims)
        store.close()

# ---- images, weights, version ------------------------------------------------------------------


def test_images_are_stored_once_and_freed_with_their_last_group(make_group) -> None:
    rng = np.random.default_rng(0)
    imgs = [rng.integers(0, 255, size=(3, 16, 16), dtype=np.uint8) for _ in range(2)]
    table, keys = images_to_table(imgs)
    store = Store()
    assert store.put_images(table) == 2
    assert store.put_images(table) == 0  # same keys: nothing new
    store.put_group("a", [make_group("a", size=2, image_keys=[keys[0]])])
    store.put_group("b", [make_group("b", size=2, image_keys=[keys[0], keys[1]])])
    got = store.images([keys[1], keys[0]])
    assert got.column("image_key").to_pylist() == [keys[1], keys[0]]
    store.release(["a"])
    assert store.images(keys[:2], missing_ok=True).num_rows == 2  # b still references both
    store.release(["b"])
    assert store.images(keys[:2], missing_ok=True).num_rows == 0
    assert store.stats().memory_used == 0
    with pytest.raises(UnknownImageError, match=keys[0].hex()) as exc:
        store.images([keys[0]])
    assert exc.value.key == keys[0].hex()


def _weights(fill: int, nbytes: int = 8) -> pa.Table:
    return pa.table({"name": ["w"], "shape": [[2]], "dtype": ["float32"], "data": [bytes([fill]) * nbytes]})


def test_weights_are_checked_and_only_the_newest_versions_kept() -> None:
    store = Store(StoreConfig(weights_versions=2))
    with pytest.raises(UnknownWeightsError):
        store.weights()
    assert store.put_weights(_weights(1), 1) and store.put_weights(_weights(2), 2)
    assert not store.put_weights(_weights(9), 2)  # not newer: ignored (a retry)
    assert not store.put_weights(_weights(0), 0)
    assert store.put_weights(_weights(3), 3)  # pushes v1 out
    with pytest.raises(UnknownWeightsError, match=r"v1 are not stored .*stored: v2, v3"):
        store.weights(1)
    assert store.weights(2)[0].column("data")[0].as_py() == bytes([2]) * 8
    table, version = store.weights()
    assert version == 3 and table.column("data")[0].as_py() == bytes([3]) * 8
    used = store.stats().memory_used
    assert isinstance(used, int) and used > 0
    with pytest.raises(SchemaMismatchError, match="holds no tensor"):
        store.put_weights(_weights(4).slice(0, 0), 4)  # a DoPut of zero batches is no weights table
    with pytest.raises(SchemaMismatchError, match="'w' has 4 bytes of data, but shape \\[2\\] of float32 needs 8"):
        store.put_weights(_weights(4, nbytes=4), 4)
    with pytest.raises(SchemaMismatchError, match="columns"):
        store.put_weights(pa.table({"name": ["w"], "data": [b"\x01\x02"]}), 4)
    assert store.weights()[1] == 3 and store.stats().memory_used == used  # nothing of them stored
    assert store.publish_version(5) == 5 and store.publish_version(3) == 5 and store.get_version() == 5


def test_concurrent_writers_on_one_store(make_group) -> None:
    store = Store()
    batches = {f"g{i}": make_group(f"g{i}", size=2) for i in range(100)}

    def write(offset: int) -> None:
        for i in range(100):
            gid = f"g{(i + offset) % 100}"
            store.put_group(gid, [batches[gid]])

    threads = [threading.Thread(target=write, args=(k * 25,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.metadata().num_rows == 200
    assert store.metadata().column("seq").to_pylist() == list(range(200))


def test_small_slices_coalesce_into_one_batch(make_group) -> None:
    store = Store()
    for g in "abcdef":
        store.put_group(g, [make_group(g, size=4)])
    refs = [("c", 1, 3), ("a", 0, 1), ("b", 3, 4), ("f", 0, 2), ("e", 2, 3)]
    views = store.slices(refs)
    one = store.slices(refs, coalesce_below=1 << 20)
    assert len(views) == 5 and len(one) == 1
    assert pa.Table.from_batches(one).equals(pa.Table.from_batches(views))
    assert len(store.slices(refs, coalesce_below=10)) == 5  # over the threshold: zero-copy views
    assert len(store.slices(refs[:4], coalesce_below=1 << 20)) == 4  # a few slices: one message each, no copy


def test_metadata_reads_interleaved_with_writes_stay_few_chunks(make_group) -> None:
    store = Store()
    for i in range(200):
        store.put_group(f"g{i}", [make_group(f"g{i}", size=1)])
        store.put_group(f"h{i}", [make_group(f"h{i}", size=1)])
        tail = store.metadata(since=2 * i)
        assert tail.column("group_id").to_pylist() == [f"g{i}", f"h{i}"]
    full = store.metadata()
    assert full.column("seq").to_pylist() == list(range(400))
    assert full.column("seq").num_chunks <= 65
