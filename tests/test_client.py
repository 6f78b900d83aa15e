"""The store clients (writer, reader, admin) over several real nodes: placement, metadata, fetch order, control."""

from __future__ import annotations

import re
import threading

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from polars.testing import assert_frame_equal

from flight_store import streams as streams_mod
from flight_store.client import StoreAdmin
from flight_store.config import ServerConfig
from flight_store.errors import NodeUnavailableError, SchemaMismatchError, UnknownGroupError, UnknownImageError
from flight_store.publishing import StorePublisher
from flight_store.reading import StoreReader
from flight_store.server import StoreServer
from flight_store.writing import StoreWriter
from schemas.arrow import METADATA_SCHEMA
from schemas.images import images_to_table
from schemas.plan import PlannedSlice
from schemas.routing import owner
from schemas.weights import WEIGHTS_SCHEMA


class _CountingServer(StoreServer):
    """A real StoreServer that counts its DoGet calls, its read channels opened and the tickets it answered
    (by either)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.doget_calls = self.channels_opened = self.answers = 0
        self._count_lock = threading.Lock()

    def do_get(self, context, ticket):  # type: ignore[no-untyped-def]
        with self._count_lock:
            self.doget_calls += 1
        return super().do_get(context, ticket)

    def do_exchange(self, context, descriptor, reader, writer):  # type: ignore[no-untyped-def]
        with self._count_lock:
            self.channels_opened += 1
        return super().do_exchange(context, descriptor, reader, writer)

    def _slices(self, refs, columns):  # type: ignore[no-untyped-def]
        with self._count_lock:
            self.answers += 1
        return super()._slices(refs, columns)

    def counts(self) -> tuple[int, int, int]:
        return self.doget_calls, self.channels_opened, self.answers


def test_placement_is_rendezvous_over_the_node_ids(store_nodes, make_group) -> None:
    servers = store_nodes(3)
    locs = [s.location for s in servers]
    with StoreWriter(locs) as client:
        assert client.nodes == locs
        written = {f"g{i}": client.put_group(make_group(f"g{i}", size=2)) for i in range(30)}
    assert all(written[g] == owner(g, locs) for g in written)  # a node's id is its location by default
    assert len(set(written.values())) == 3  # 30 groups spread over every node
    for s in servers:
        assert sorted(s.store.group_ids()) == sorted(g for g, n in written.items() if n == s.location)
    with StoreReader(locs) as again:  # a new client places the same way
        assert all(again.node_for(g) == n for g, n in written.items())


def test_scan_metadata_fans_out_with_node_column(store_nodes, make_group) -> None:
    servers = store_nodes(2)
    locs = [s.location for s in servers]
    with StoreReader(locs) as client, StoreWriter.sharing(client) as writer:
        empty = client.scan_metadata(columns=["group_id", "reward"])
        assert empty.height == 0 and empty.columns == ["seq", "group_id", "reward", "node"]
        assert empty.schema["node"] == pl.String and empty.schema["reward"] == pl.Float32
        full_empty = client.scan_metadata()
        assert full_empty.columns == [*METADATA_SCHEMA.names, "node"]
        writer.put_group(make_group("a", size=3), node=locs[0])
        writer.put_group(make_group("b", size=2), node=locs[1])
        frame = client.scan_metadata(columns=["group_id", "sample_idx"])
        assert dict(frame.schema) == {"seq": pl.Int64, "group_id": pl.String, "sample_idx": pl.Int32, "node": pl.String}
        got = frame.sort("group_id", "sample_idx").select("node", "group_id", "seq").rows()
        assert got == [(locs[0], "a", 0), (locs[0], "a", 1), (locs[0], "a", 2), (locs[1], "b", 0), (locs[1], "b", 1)]
        since = client.scan_metadata(since={locs[0]: 2}, columns=["group_id", "node"])
        assert sorted(since["group_id"].to_list()) == ["a", "b", "b"]
        lazy = client.metadata()
        assert isinstance(lazy, pl.LazyFrame)
        assert lazy.group_by("group_id").len().sort("group_id").collect()["len"].to_list() == [3, 2]


def test_scan_new_returns_each_row_once(store_nodes, make_group) -> None:
    servers = store_nodes(2)
    with StoreReader([s.location for s in servers]) as client, StoreWriter.sharing(client) as writer:
        for i in range(5):
            writer.put_group(make_group(f"g{i}", size=2))
        first = client.scan_new(columns=["group_id"])
        assert first.height == 10
        assert client.scan_new(columns=["group_id"]).height == 0
        writer.put_group(make_group("late", size=3))
        writer.put_group(make_group("g0", size=2))  # duplicate: no new rows
        new = client.scan_new()
        assert new["group_id"].to_list() == ["late"] * 3
        assert_frame_equal(client.scan_new(), new.clear())


def test_fetch_one_read_per_node_over_kept_channels_in_slice_order(make_group) -> None:
    servers = [_CountingServer() for _ in range(3)]
    try:
        locs = [s.location for s in servers]
        with StoreReader(locs) as client, StoreWriter.sharing(client) as writer:
            for i in range(12):  # node 0's groups carry writer metadata, which comes back with their rows
                group = make_group(f"g{i}", size=4)
                meta = {"knittrans.logprobs_mode": "processed_logprobs"} if i % 3 == 0 else {}
                writer.put_group(group.replace_schema_metadata({**group.schema.metadata, **meta}), node=locs[i % 3])
            rng = np.random.default_rng(1)
            plan = [(f"g{i}", int(a), int(a) + 2) for i in rng.permutation(12) for a in [rng.integers(0, 3)]]
            slices = [PlannedSlice(node=locs[int(g[1:]) % 3], group_id=g, start=a, stop=b) for g, a, b in plan]
            cols = ["group_id", "sample_idx", "response_ids"]
            want = [(g, k) for g, a, b in plan for k in range(a, b)]
            for attempt in range(3):  # one answer per node each time; channels opened once (no DoGet)
                table = client.fetch(slices, columns=cols)
                assert [s.counts() for s in servers] == [(0, 1, 1 + attempt)] * 3
                assert list(zip(table["group_id"].to_pylist(), table["sample_idx"].to_pylist(), strict=True)) == want
            for start in range(4):  # beginning at another node changes what is asked first, not what comes back
                table = client.fetch(slices, columns=cols, start=start)
                assert list(zip(table["group_id"].to_pylist(), table["sample_idx"].to_pylist(), strict=True)) == want
            for node in locs:  # the same table, schema metadata included, as one DoGet of the node's slices
                mine = [s for s in slices if s.node == node]
                by_doget = client._calls.get(node, streams_mod.slices_ticket(mine, cols))
                assert by_doget.equals(client.fetch(mine, columns=cols), check_metadata=True)
            node0 = client.fetch([s for s in slices if s.node == locs[0]], columns=cols).schema.metadata
            assert node0[b"knittrans.logprobs_mode"] == b"processed_logprobs"
            assert b"knittrans.logprobs_mode" not in client.fetch(slices, columns=cols).schema.metadata  # not shared
            assert client.fetch(slices, columns=["sample_idx"]).num_rows == len(want)  # another projection: a channel
            assert [s.channels_opened for s in servers] == [2, 2, 2]
            assert client.fetch([], columns=["sample_idx"]).num_rows == 0
    finally:
        for s in servers:
            s.shutdown()


def test_ranks_reading_at_once_begin_on_different_nodes() -> None:
    nodes = ["a", "b", "c"]
    every = {n: [] for n in nodes}
    assert [streams_mod.staggered(every, nodes, r)[0] for r in range(3)] == nodes  # rank r begins at node r
    assert [streams_mod.staggered(every, nodes, r + 1) for r in range(2)] == [["b", "c", "a"], ["c", "a", "b"]]
    some = {"c": [], "a": [], "x": []}  # a node the client does not list is asked last
    assert [streams_mod.staggered(some, nodes, r) for r in range(4)] == [["a", "c", "x"], ["c", "a", "x"],
                                                                        ["c", "a", "x"], ["a", "c", "x"]]


class _BreakingServer(_CountingServer):
    """Ends its first ``breaks`` read channels right after their first request arrives, answering nothing."""

    breaks = 1

    def do_exchange(self, context, descriptor, reader, writer):  # type: ignore[no-untyped-def]
        if self.breaks:
            self.breaks -= 1
            reader.read_chunk()
            return None
        return super().do_exchange(context, descriptor, reader, writer)


def test_read_channel_refusals_are_typed_and_broken_or_old_channels_are_replaced(make_group, monkeypatch) -> None:
    import time

    from flight_store import calls

    monkeypatch.setattr(calls, "CHANNEL_LIFETIME_S", 1.6)  # channels live 1.6 s, serve reads for 0.8 s
    server = _BreakingServer()
    stopped = False
    try:
        loc = server.location
        with StoreReader([loc]) as client, StoreWriter.sharing(client) as writer:
            writer.put_group(make_group("g", size=4))
            part = [PlannedSlice(node=loc, group_id="g", start=1, stop=3)]
            # the first channel ends without an answer: that read is made by DoGet
            assert client.fetch(part, columns=["sample_idx"])["sample_idx"].to_pylist() == [1, 2]
            assert server.counts() == (1, 0, 1)  # the broken channel never reached the counting handler
            assert client.fetch(part, columns=["sample_idx"])["sample_idx"].to_pylist() == [1, 2]
            assert server.counts() == (1, 1, 2)  # a new channel, no DoGet
            with pytest.raises(UnknownGroupError, match="'nope'"):
                client.fetch([PlannedSlice(node=loc, group_id="nope", start=0, stop=1)], columns=["sample_idx"])
            assert client.fetch(part, columns=["sample_idx"]).num_rows == 2
            assert server.counts() == (1, 1, 4)  # the refusal was answered on the channel, which goes on
            with pytest.raises(SchemaMismatchError, match="'bogus'"):  # refused when its channel opens, then by DoGet
                client.fetch(part, columns=["bogus"])
            time.sleep(0.85)  # no longer fresh: the next read opens a new channel
            assert client.fetch(part, columns=["sample_idx"]).num_rows == 2
            assert (server.doget_calls, server.channels_opened) == (2, 3)
            time.sleep(1.7)  # every channel of the client has passed its deadline: a stopping node waits for none
            t0 = time.monotonic()
            stopped = server.shutdown(timeout_s=5)
            assert stopped and time.monotonic() - t0 < 2
    finally:
        if not stopped:
            server.shutdown()


def _keys(table: pa.Table) -> list[tuple[str, int]]:
    return list(zip(table["group_id"].to_pylist(), table["sample_idx"].to_pylist(), strict=True))


@pytest.mark.parametrize("coalesce_below", [0, 1 << 20])  # one batch per slice run / all slices in one batch
def test_stream_yields_each_micro_batch_in_order_over_read_channels(make_group, coalesce_below: int) -> None:
    servers = [_CountingServer(ServerConfig(coalesce_below=coalesce_below)) for _ in range(2)]
    try:
        locs = [s.location for s in servers]
        with StoreReader(locs) as client, StoreWriter.sharing(client) as writer:
            for i in range(10):
                writer.put_group(make_group(f"g{i}", size=4, response_len=3 + i), node=locs[i % 2])
            rng = np.random.default_rng(2)
            micro_batches = []
            for _ in range(5):  # mixed nodes, partial groups, uneven sizes
                picks = rng.choice(10, size=int(rng.integers(1, 4)), replace=False)
                micro_batches.append([
                    PlannedSlice(node=locs[int(i) % 2], group_id=f"g{i}", start=a, stop=a + int(rng.integers(1, 5 - a)))
                    for i in picks for a in [int(rng.integers(0, 3))]
                ])
            micro_batches.insert(2, [])  # an empty micro-batch yields an empty table
            cols = ["group_id", "sample_idx", "response_ids"]
            before = [s.doget_calls for s in servers]
            got = list(client.stream(micro_batches, columns=cols))
            assert [s.doget_calls - b for s, b in zip(servers, before, strict=True)] == [0, 0]  # no call per read
            assert len(got) == len(micro_batches)
            for mb, table in zip(micro_batches, got, strict=True):
                assert table.column_names == cols
                assert _keys(table) == [(s.group_id, k) for s in mb for k in range(s.start, s.stop)]
                if mb:  # the same rows and bytes fetch() returns
                    assert table.equals(client.fetch(mb, columns=cols))
    finally:
        for s in servers:
            s.shutdown()


def test_stream_errors_are_typed_and_an_abandoned_stream_reads_no_further(store_nodes, make_group) -> None:
    (server,) = store_nodes(1)
    node = server.location
    with StoreReader(node) as client, StoreWriter.sharing(client) as writer:
        for i in range(4):
            writer.put_group(make_group(f"g{i}", size=4, response_len=4096))
        mbs = [[PlannedSlice(node=node, group_id=f"g{i}", start=0, stop=4)] for i in range(4)]
        with pytest.raises(UnknownGroupError, match="ghost"):
            list(client.stream([*mbs, [PlannedSlice(node=node, group_id="ghost", start=0, stop=1)]]))
        stream = client.stream(mbs)
        assert _keys(next(stream))[0] == ("g0", 0)
        stream.close()  # the caller stops early: nothing more is read, the node keeps serving
        assert [_keys(t)[0] for t in client.stream(mbs)] == [(f"g{i}", 0) for i in range(4)]


def test_stream_reads_a_node_by_doget_when_its_read_channel_breaks(store_nodes, make_group, monkeypatch) -> None:
    servers = store_nodes(2)
    locs = [s.location for s in servers]
    with StoreReader(locs, backoff=0.01) as client, StoreWriter.sharing(client) as writer:
        for i in range(6):
            writer.put_group(make_group(f"g{i}", size=2), node=locs[i % 2])
        mbs = [[PlannedSlice(node=locs[i % 2], group_id=f"g{i}", start=0, stop=2) for i in (k, k + 1)]
               for k in (0, 2, 4)]
        broken = {"calls": 0}
        real_receive = streams_mod.ReadChannel.receive

        def flaky_receive(self):  # type: ignore[no-untyped-def]
            if self.node == locs[1]:
                broken["calls"] += 1
                self.close()
                raise streams_mod.ChannelBrokenError("connection reset (injected)")
            return real_receive(self)

        monkeypatch.setattr(streams_mod.ReadChannel, "receive", flaky_receive)
        got = [_keys(t) for t in client.stream(mbs)]
        assert got == [[(f"g{i}", 0), (f"g{i}", 1), (f"g{i + 1}", 0), (f"g{i + 1}", 1)] for i in (0, 2, 4)]
        assert broken["calls"] == 3  # each micro-batch's read of node 1 was made again by DoGet
        servers[1].shutdown()
        with pytest.raises(NodeUnavailableError, match=re.escape(locs[1])) as exc:
            list(client.stream(mbs))
        assert exc.value.group_ids == ["g1"]


def test_images_release_version_and_weights(store_nodes, make_group) -> None:
    servers = store_nodes(2)
    locs = [s.location for s in servers]
    with StoreReader(locs) as client, StoreWriter.sharing(client) as writer, \
            StorePublisher.sharing(client) as publisher:
        table, keys = images_to_table([np.full((2, 4, 4), v, dtype=np.uint8) for v in range(3)])
        with pytest.raises(ValueError, match="group_ids"):
            writer.put_images(table)  # images go to the node(s) of the groups that reference them
        a, b = (next(g for g in (f"g{i}" for i in range(99)) if client.node_for(g) == n) for n in locs)
        assert writer.put_images(table, group_ids=[a]) == 3
        assert writer.put_images(table.slice(1), group_ids=[a, b]) == 2  # node of a has them; node of b stores 2
        held = [s.store.images([keys[0]], missing_ok=True).num_rows for s in servers[:2]]
        assert held == [1, 0]
        got = client.fetch_images([keys[2], keys[0], keys[2], keys[1]])  # found wherever they are, once each
        assert got.column("image_key").to_pylist() == [keys[2], keys[0], keys[1]]
        assert client.fetch_images([keys[1]], nodes={keys[1]: locs[1]}).num_rows == 1
        with pytest.raises(UnknownImageError, match=bytes(32).hex()):
            client.fetch_images([bytes(32)])
        writer.put_group(make_group(a, size=2))
        writer.put_group(make_group(b, size=2))
        assert client.release([a, b, "never"]) == {locs[0]: 1, locs[1]: 1}
        assert client.release([a]) == {locs[0]: 0, locs[1]: 0}
        assert client.get_version() == 0
        publisher.publish_version(7)
        assert client.get_version() == 7
        weights = pa.table(
            {"name": ["w1", "w2"], "shape": [[2], [1]], "dtype": ["float32"] * 2, "data": [b"\0" * 8, b"\1" * 4]}
        )
        publisher.put_weights(weights, 3)
        for loc in locs:
            assert writer.get_weights(node=loc).equals(weights.cast(WEIGHTS_SCHEMA))  # stored as the schema says
        assert writer.get_weights(3).num_rows == 2
        stats = client.stats()
        assert set(stats) == set(locs) and all(s.weights_version == 3 for s in stats.values())


def test_token_is_sent_as_bearer_header(monkeypatch, tmp_path) -> None:
    # a node requiring a token answers only a call whose header is exactly "Bearer <token>"
    servers = []
    for token in ("s3cret", "from-env"):
        (tmp_path / token).write_text(token, encoding="utf-8")
        (tmp_path / token).chmod(0o600)
        servers.append(StoreServer(ServerConfig(auth_token_file=str(tmp_path / token))))
    try:
        explicit, from_env = (s.location for s in servers)
        monkeypatch.delenv("KNIT_TOKEN", raising=False)
        with StoreAdmin(explicit, token="s3cret") as client:
            assert client.health()[explicit].ok is True
        monkeypatch.setenv("KNIT_TOKEN", "from-env")
        with StoreReader(from_env) as client:
            assert client.stats()[from_env].rows == 0
        with StoreReader(explicit) as client, pytest.raises(flight.FlightUnauthenticatedError):
            client.stats()  # the environment's token, not the explicit one
    finally:
        for s in servers:
            s.shutdown()


def test_unreachable_node(store_nodes) -> None:
    (server,) = store_nodes(1)
    dead = "grpc://127.0.0.1:1"
    with StoreReader([server.location, dead], timeout=5) as client, StoreAdmin.sharing(client) as admin:
        health = admin.health()
        assert health[server.location].ok and not health[dead].ok and health[dead].error
        with pytest.raises(NodeUnavailableError, match=re.escape("127.0.0.1:1")) as exc:
            client.scan_metadata()
        assert exc.value.node == dead and exc.value.retryable
    with pytest.raises(ValueError, match="unknown node"):
        StoreReader(server.location).fetch([PlannedSlice(node=dead, group_id="g", start=0, stop=1)])
