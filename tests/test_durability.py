"""Durable spill: fsynced writes survive a restart and a SIGKILL; torn tails are dropped; releases stick."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from flight_store.config import ServerConfig, StoreConfig
from flight_store.errors import CapacityExceededError, GroupReleasedError
from flight_store.reading import StoreReader
from flight_store.spill import LOG_NAME, SpillCorruptionError, SpillLog
from flight_store.store import Store
from flight_store.writing import StoreWriter
from schemas.images import images_to_table
from schemas.plan import PlannedSlice


def _meta(store: Store) -> list[tuple[int, str, int]]:
    t = store.metadata(columns=["group_id", "sample_idx"])
    return list(zip(t.column("seq").to_pylist(), t.column("group_id").to_pylist(), t.column("sample_idx").to_pylist(),
                    strict=True))


def test_restart_restores_groups_seq_images_weights_version(tmp_path: Path, make_group) -> None:
    img = np.arange(12, dtype=np.uint8).reshape(3, 4)
    images, (key,) = images_to_table([img])
    store = Store(StoreConfig(spill_dir=str(tmp_path), memory_budget=1 << 26))
    store.put_group("a", [make_group("a", size=4)])
    store.put_group("b", [make_group("b", size=3)])
    assert store.put_group("b", [make_group("b", size=3)]) == 0  # a retry: a no-op, not logged
    assert store.put_images(images) == 1  # a group's images before the group
    store.put_group("c", [make_group("c", size=2, image_keys=[key], num_images=1)])
    store.put_weights(pa.table({"name": ["w"], "shape": [[1]], "dtype": ["int16"], "data": [b"\x01\x02"]}), 7)
    store.publish_version(5)
    assert store.release(["a", "a", "ghost"]) == 1
    before = _meta(store)
    stats = store.stats()
    store.close()

    again = Store(StoreConfig(spill_dir=str(tmp_path), memory_budget=1 << 26))
    assert _meta(again) == before  # same rows, same seq
    assert again.group_ids() == ["b", "c"]
    assert again.recovered == {"records": 7, "groups": 2, "released": 1, "rows": 9}
    with pytest.raises(GroupReleasedError):  # released groups are not resurrected
        again.slices([("a", 0, 1)])
    got = pa.Table.from_batches(again.slices([("b", 0, 3)], columns=["sample_idx", "response_ids"]))
    assert got.column("sample_idx").to_pylist() == [0, 1, 2]
    assert got.column("response_ids").to_pylist() == make_group("b", size=3).column("response_ids").to_pylist()
    assert again.images([key]).column("data")[0].as_py() == img.tobytes()
    weights, version = again.weights()
    assert version == 7 and weights.column("data").to_pylist() == [b"\x01\x02"]
    assert again.get_version() == 5
    for k in ("rows_stored", "metadata_rows", "groups", "images"):
        assert getattr(again.stats(), k) == getattr(stats, k), k
    for k in ("bytes", "memory_used"):  # buffer padding may differ by a few bytes after the IPC round trip
        assert getattr(again.stats(), k) == pytest.approx(getattr(stats, k), rel=0.02), k
    # numbering continues; a release after the restart sticks too (and frees the image)
    again.put_group("d", [make_group("d", size=2)])
    assert _meta(again)[-2:] == [(9, "d", 0), (10, "d", 1)]
    again.release(["c"])
    assert again.images([key], missing_ok=True).num_rows == 0
    again.close()
    third = Store(StoreConfig(spill_dir=str(tmp_path)))
    assert third.group_ids() == ["b", "d"] and len(_meta(third)) == 11
    assert third.images([key], missing_ok=True).num_rows == 0
    third.close()


@pytest.mark.parametrize("damage", ["cut_in_body", "cut_in_header", "zeros"])
def test_a_torn_tail_is_dropped_with_a_log_line(tmp_path: Path, make_group, caplog, damage: str) -> None:
    store = Store(StoreConfig(spill_dir=str(tmp_path)))
    for g in ("a", "b"):
        store.put_group(g, [make_group(g, size=4)])
    intact = (tmp_path / LOG_NAME).stat().st_size
    store.put_group("c", [make_group("c", size=4)])
    store.close()
    path = tmp_path / LOG_NAME
    data = path.read_bytes()
    if damage == "cut_in_body":  # an append a crash interrupted: never acknowledged
        data = data[:-7]
    elif damage == "cut_in_header":
        data = data[: intact + 9]
    else:  # the file ends in zeros a crash left
        data = data + bytes(64)
    path.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="flight_store.spill"):
        again = Store(StoreConfig(spill_dir=str(tmp_path)))
    assert any("torn tail" in r.getMessage() for r in caplog.records)
    want = ["a", "b"] if damage != "zeros" else ["a", "b", "c"]
    assert again.group_ids() == want
    assert sorted({g for _, g, _ in _meta(again)}) == want  # no partial group visible
    assert path.stat().st_size == (intact if damage != "zeros" else len(data) - 64)
    again.put_group("d", [make_group("d", size=1)])  # appends continue after the intact prefix
    again.close()
    last = Store(StoreConfig(spill_dir=str(tmp_path)))
    assert last.group_ids() == [*want, "d"]
    last.close()


def _log_of_eleven(tmp_path: Path, make_group) -> tuple[Path, list[int]]:
    """A spill log of 11 records (9 groups, a release, a version; the weights in their own file) and the offset of
    each frame."""
    store = Store(StoreConfig(spill_dir=str(tmp_path)))
    offsets = []
    for i in range(9):
        offsets.append((tmp_path / LOG_NAME).stat().st_size)
        store.put_group(f"g{i}", [make_group(f"g{i}", size=4)])
        if i == 1:
            offsets.append((tmp_path / LOG_NAME).stat().st_size)
            store.release(["g0"])
    offsets.append((tmp_path / LOG_NAME).stat().st_size)
    store.put_weights(pa.table({"name": ["w"], "shape": [[1]], "dtype": ["int16"], "data": [b"\x01\x02"]}), 3)
    offsets.append((tmp_path / LOG_NAME).stat().st_size)
    store.publish_version(5)
    store.close()
    return tmp_path / LOG_NAME, offsets


@pytest.mark.parametrize("damage", ["flipped_byte_in_frame_3", "bad_magic_in_frame_3", "garbage_after_the_end"])
def test_damage_inside_the_log_refuses_to_start_and_never_truncates(tmp_path: Path, make_group,
                                                                     damage: str) -> None:
    path, offsets = _log_of_eleven(tmp_path, make_group)
    data = bytearray(path.read_bytes())
    where = offsets[3]
    if damage == "flipped_byte_in_frame_3":
        data[where + 60] ^= 0xFF
    elif damage == "bad_magic_in_frame_3":
        data[where:where + 4] = b"XXXX"
    else:
        where = len(data)
        data += b"\x00garbage-after-a-crash"
    path.write_bytes(bytes(data))
    with pytest.raises(SpillCorruptionError, match=f"corrupt at offset {where}") as exc:
        Store(StoreConfig(spill_dir=str(tmp_path)))
    assert exc.value.offset == where and exc.value.path == str(path)
    assert path.read_bytes() == bytes(data)  # nothing truncated, nothing lost

    salvaged = Store(StoreConfig(spill_dir=str(tmp_path), spill_recovery="salvage"))
    lost = {"flipped_byte_in_frame_3": ["g2"], "bad_magic_in_frame_3": ["g2"], "garbage_after_the_end": []}[damage]
    assert salvaged.group_ids() == [f"g{i}" for i in range(1, 9) if f"g{i}" not in lost]  # every intact frame
    assert salvaged.get_version() == 5 and salvaged.weights()[1] == 3  # ... also those after the damage
    assert salvaged.put_group("g0", [make_group("g0", size=4)]) == 0  # still released: not trained twice
    salvaged.close()
    assert list(tmp_path.glob(f"{LOG_NAME}.corrupt-*"))  # the damaged file is kept aside
    third = Store(StoreConfig(spill_dir=str(tmp_path)))
    assert third.group_ids() == [f"g{i}" for i in range(1, 9) if f"g{i}" not in lost]
    third.close()


def test_a_record_that_does_not_decode_is_named_not_a_traceback(tmp_path: Path) -> None:
    from flight_store.spill import SpillLog

    spill = SpillLog(tmp_path)
    spill.append({"kind": "version", "version": 2})
    spill.append({"kind": "group", "group_id": "bad"}, b"not an arrow stream")  # checksum valid, content not
    spill.close()
    with pytest.raises(SpillCorruptionError, match="the 'group' record at offset") as exc:
        Store(StoreConfig(spill_dir=str(tmp_path)))
    assert exc.value.offset > 0
    again = Store(StoreConfig(spill_dir=str(tmp_path), spill_recovery="salvage"))
    assert again.get_version() == 2 and again.group_ids() == []
    again.close()


def test_compaction_keeps_the_log_proportional_to_what_is_live(tmp_path: Path, make_group) -> None:
    store = Store(StoreConfig(spill_dir=str(tmp_path), spill_compact_bytes=64 << 10, history_rows=40))
    w = pa.table({"name": ["w"], "shape": [[1]], "dtype": ["int16"], "data": [b"\x01\x02"]})
    sizes = []
    for i in range(200):
        store.put_group(f"g{i}", [make_group(f"g{i}", size=4, response_len=64)])
        if i >= 3:
            store.release([f"g{i - 3}"])  # three groups live at any time
        if i % 50 == 0:
            store.put_weights(w, i)
        sizes.append((tmp_path / LOG_NAME).stat().st_size)
    stats = store.stats()
    assert stats.spill_compactions > 3 and max(sizes[100:]) < 3 * (64 << 10)  # bounded, not 200 groups' worth
    assert stats.metadata_rows_held <= 4 * 3 + 40 + 10  # live rows + the bounded history
    before = _meta(store)
    live = store.group_ids()
    store.close()
    again = Store(StoreConfig(spill_dir=str(tmp_path), history_rows=40))
    assert again.group_ids() == live == ["g197", "g198", "g199"]
    assert [m for m in _meta(again) if m[1] in live] == [m for m in before if m[1] in live]  # same seq
    assert again.put_group("g10", [make_group("g10", size=4, response_len=64)]) == 0  # a tombstone recognises it
    assert again.weights()[1] == 150 and again.stats().weights_version == 150
    again.put_group("new", [make_group("new", size=1)])
    assert _meta(again)[-1][0] == 800  # numbering continues after every row ever written
    again.close()


def test_weights_are_written_once_each_in_their_own_file_and_superseded_ones_leave(tmp_path: Path) -> None:
    """Each version's weights go to one file beside the log (never into it, so no compaction copies them again);
    only the kept versions' files stay; a restart restores them; a damaged file is named, or skipped by salvage."""
    store = Store(StoreConfig(spill_dir=str(tmp_path), weights_versions=2, spill_compact_bytes=1 << 10))
    data = np.arange(50_000, dtype=np.int16).tobytes()  # 100 KB a version, the log's compaction threshold 1 KB
    for version in range(6):
        store.put_weights(pa.table({"name": ["w"], "shape": [[50_000]], "dtype": ["int16"],
                                    "data": [data[:-2] + bytes([version, 0])]}), version)
        store.publish_version(version)
    kept = sorted(p.name for p in tmp_path.glob("weights-*"))
    assert kept == ["weights-000000000004.log", "weights-000000000005.log"]
    assert (tmp_path / LOG_NAME).stat().st_size < 1 << 10  # version records, no weights bytes
    store.close()
    log = SpillLog(tmp_path)
    assert {r.header["kind"] for r in log.records()} <= {"version", "state"}
    log.close()

    again = Store(StoreConfig(spill_dir=str(tmp_path), weights_versions=2))
    table, version = again.weights()
    assert version == 5 and again.get_version() == 5 and table.column("data")[0].as_py()[-2:] == bytes([5, 0])
    assert again.weights(4)[1] == 4
    again.close()

    newest = tmp_path / "weights-000000000005.log"
    damaged = bytearray(newest.read_bytes())
    damaged[-100] ^= 0xFF
    newest.write_bytes(bytes(damaged))
    with pytest.raises(SpillCorruptionError, match=r"weights-000000000005\.log is corrupt") as exc:
        Store(StoreConfig(spill_dir=str(tmp_path)))
    assert exc.value.path == str(newest) and newest.read_bytes() == bytes(damaged)  # refused, nothing removed
    salvaged = Store(StoreConfig(spill_dir=str(tmp_path), spill_recovery="salvage"))
    assert salvaged.weights()[1] == 4 and salvaged.get_version() == 5  # the intact version is served
    assert list(tmp_path.glob("weights-000000000005.log.corrupt-*"))
    salvaged.close()


def test_reads_and_group_writes_go_on_while_a_weights_file_is_written(tmp_path: Path, make_group,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A weights version (hundreds of MB at real size) is copied and written to disk without the store's lock:
    the trainer's reads and the rollout's group writes are served meanwhile. A version the budget refuses
    leaves no file."""
    store = Store(StoreConfig(spill_dir=str(tmp_path), memory_budget=1 << 20))
    store.put_group("g", [make_group("g", size=4)])
    gate, writing = threading.Event(), threading.Event()
    write = store._journal.weights

    def slow_write(*args: object) -> None:
        writing.set()
        assert gate.wait(30)
        write(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(store._journal, "weights", slow_write)
    w = pa.table({"name": ["w"], "shape": [[1]], "dtype": ["int16"], "data": [b"\x01\x02"]})
    publish = threading.Thread(target=store.put_weights, args=(w, 1))
    publish.start()
    served: list[int] = []

    def read_and_write() -> None:
        served.append(sum(b.num_rows for b in store.slices([("g", 0, 4)])))
        served.append(store.put_group("h", [make_group("h", size=4)]))

    try:
        assert writing.wait(30)
        other = threading.Thread(target=read_and_write)
        other.start()
        other.join(10)
        assert served == [4, 4]  # both served while the weights file is being written
    finally:
        gate.set()
        publish.join(30)
    assert store.weights()[1] == 1 and store.group_ids() == ["g", "h"]
    monkeypatch.undo()

    big = pa.table({"name": ["w"], "shape": [[1 << 20]], "dtype": ["int16"], "data": [bytes(2 << 20)]})
    with pytest.raises(CapacityExceededError):
        store.put_weights(big, 2)
    assert sorted(p.name for p in tmp_path.glob("weights-*")) == ["weights-000000000001.log"]
    store.close()


def _stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
    proc.wait(timeout=30)
    if proc.stdout is not None:
        proc.stdout.close()


def test_sigkill_during_four_writers_loses_no_acknowledged_group(tmp_path: Path, make_group, node_process) -> None:
    node = ServerConfig(log_level="WARNING", store=StoreConfig(spill_dir=str(tmp_path / "spill")))
    proc, loc = node_process(node)
    acked: list[list[str]] = [[] for _ in range(4)]
    released: list[str] = []
    stop = threading.Event()

    def writer(w: int) -> None:
        with StoreWriter(loc, timeout=5, retries=0) as client:
            i = 0
            while not stop.is_set():
                gid = f"w{w}-g{i}"
                try:
                    client.put_group(make_group(gid, size=4, response_len=64), node=loc)
                except Exception:  # the node was killed: what was acknowledged must survive
                    return
                acked[w].append(gid)
                i += 1

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    try:
        for t in threads:
            t.start()
        with StoreReader(loc, timeout=5) as client:
            while sum(map(len, acked)) < 40:
                time.sleep(0.01)
            to_release = [a[0] for a in acked]
            client.release(to_release)
            released.extend(to_release)
            snapshot = client.scan_metadata(columns=["group_id", "sample_idx"])
            deadline = time.monotonic() + 60
            while sum(map(len, acked)) < 200 and time.monotonic() < deadline:
                time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)  # mid-stream: the writers are still sending
        proc.wait(timeout=30)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        _stop(proc)
    all_acked = [g for a in acked for g in a]
    assert len(all_acked) >= 200 and all(len(a) > 10 for a in acked)

    proc, loc = node_process(node)
    try:
        with StoreReader(loc) as client, StoreWriter.sharing(client) as writer:
            meta = client.scan_metadata(columns=["group_id", "sample_idx"])
            rows = meta.group_by("group_id").agg(n=pl.col("sample_idx").count(), k=pl.col("sample_idx").n_unique())
            counts = dict(zip(rows["group_id"].to_list(), zip(rows["n"].to_list(), rows["k"].to_list(), strict=True),
                              strict=True))
            assert all(v == (4, 4) for v in counts.values()), "a partial or duplicated group is visible"
            missing = set(all_acked) - set(counts)
            assert not missing, f"acknowledged groups lost: {sorted(missing)[:5]}"
            assert len(counts) - len(all_acked) <= 4  # at most one committed-but-unacknowledged group per writer
            seqs = meta["seq"].to_list()
            assert sorted(seqs) == list(range(len(seqs)))
            # the rows seen before the kill kept their seq
            joined = snapshot.drop("node").join(meta.drop("node"), on="seq", suffix="_after")
            assert joined.height == snapshot.height > 0
            assert (joined["group_id"] == joined["group_id_after"]).all()
            assert (joined["sample_idx"] == joined["sample_idx_after"]).all()
            live = set(all_acked) - set(released)
            slices = [PlannedSlice(node=loc, group_id=g, start=0, stop=4) for g in sorted(live)]
            table = client.fetch(slices, columns=["group_id", "sample_idx", "response_ids"])
            assert table.num_rows == 4 * len(live)
            assert table.column("response_ids").to_pylist()[:4] == make_group(
                sorted(live)[0], size=4, response_len=64
            ).column("response_ids").to_pylist()
            stats = client.stats()[loc]
            assert stats.groups.released == len(released)
            for g in released:  # released before the kill: not resurrected
                with pytest.raises(GroupReleasedError):
                    client.fetch([PlannedSlice(node=loc, group_id=g, start=0, stop=1)])
            writer.put_group(make_group("after-restart", size=2), node=loc)
            new = client.scan_metadata(since={loc: len(seqs)})
            assert new["seq"].to_list() == [len(seqs), len(seqs) + 1]
    finally:
        _stop(proc)


def test_a_group_record_is_its_stored_blocks_byte_for_byte(make_group) -> None:  # type: ignore[no-untyped-def]
    """The log writes a group from the blocks the store holds (no second encoding): the same IPC stream."""
    from flight_store.blocks import pack
    from flight_store.spill import decode_batches, encode_batches, stream_of_messages
    from flight_store.validate import normalize_group
    from schemas.arrow import TRAJECTORY_SCHEMA

    small = normalize_group([make_group("s", size=2)], "s", 2)[0]  # a block from the Arrow pool
    large = normalize_group([make_group("l", size=4, response_len=4096)], "l", 4)[0]  # a block of its own pages
    blocks = [pack(small)[0], pack(large)[0]]
    assert {type(b).__name__ for b in blocks} == {"Buffer", "mmap"}
    body = b"".join(bytes(piece) for piece in stream_of_messages(TRAJECTORY_SCHEMA, blocks))
    assert body == encode_batches([small, large])
    back = decode_batches(body)
    assert back[0].equals(small) and back[1].equals(large)
