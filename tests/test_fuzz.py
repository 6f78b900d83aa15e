"""Hypothesis-driven bad input against one live node: always a typed Flight error, never a crash or hang.

Every example goes over real gRPC (raw ``pyarrow.flight`` calls, so no client-side checks help) to a
module-scoped server. A refusal must be a ``FlightError`` carrying a project error class in its
``extra_info`` (never ``FlightInternalError``, i.e. an unexpected exception), each call has a deadline
(a hang fails), and after every example the node still answers ``health``. Each test also counts its
own examples: every entry point is tried at least :data:`MIN_TRIED` times, and where the inputs are
meant to be bad most of them are refused (a generator that produced only valid input would fail).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flight_store.config import ServerConfig, StoreConfig
from flight_store.errors import ERROR_CLASSES, KnitError, from_flight_error
from flight_store.server import StoreServer
from schemas.arrow import SCHEMA_VERSION
from schemas.records import TrajectoryRecord, records_to_batch
from schemas.replies import ACTION_DESCRIPTIONS
from schemas.wire import PutGroup

OPTIONS = flight.FlightCallOptions(timeout=10)
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)
MIN_TRIED = 20


@dataclass
class _Tally:
    """Examples one fuzz test ran, and how many of them the node refused."""

    tried: int = 0
    refused: int = 0

    def add(self, refused: bool) -> None:
        self.tried += 1
        self.refused += refused

    def check(self, what: str, *, mostly_refused: bool) -> None:
        assert self.tried >= MIN_TRIED, f"{what}: only {self.tried} examples ran"
        if mostly_refused:
            assert self.refused >= self.tried // 2, f"{what}: only {self.refused} of {self.tried} refused"


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[StoreServer, flight.FlightClient]]:
    with StoreServer(ServerConfig(store=StoreConfig(memory_budget=32 << 20))) as server:
        raw = flight.connect(server.location)
        _put(raw, PutGroup(group_id="known", rows=4).to_bytes(), _group("known", 4))
        yield server, raw
        raw.close()


def _group(gid: str, n: int) -> pa.RecordBatch:
    return records_to_batch(
        [
            TrajectoryRecord(group_id=gid, sample_idx=i, policy_version=0, prompt_ids=[1, 2], response_ids=[3, 4, 5],
                             response_logprobs=[-0.1, -0.2, -0.3], reward=float(i % 2))
            for i in range(n)
        ]
    )


def _put(raw: flight.FlightClient, descriptor: bytes | str, table: pa.Table | pa.RecordBatch) -> Any:
    t = pa.Table.from_batches([table]) if isinstance(table, pa.RecordBatch) else table
    d = descriptor if isinstance(descriptor, bytes) else descriptor.encode()
    writer, reader = raw.do_put(flight.FlightDescriptor.for_command(d), t.schema, OPTIONS)
    try:
        writer.write_table(t)
        writer.done_writing()
        buf = reader.read()
    finally:
        writer.close()
    return json.loads(buf.to_pybytes()) if buf is not None else None


def _typed_or_ok(what: str, call: Callable[[], object], raw: flight.FlightClient) -> bool:
    """Run ``call``: it may succeed or raise a typed project error; then the node must still be healthy.

    Returns whether the call was refused.
    """
    refused = False
    try:
        call()
    except flight.FlightError as exc:
        refused = True
        assert not isinstance(exc, flight.FlightInternalError | flight.FlightTimedOutError), f"{what}: {exc!r}"
        typed = from_flight_error(exc)
        assert isinstance(typed, KnitError), f"{what}: untyped error {exc!r}"
        assert str(typed), f"{what}: empty message"
    health = list(raw.do_action(flight.Action("health", b""), OPTIONS))
    assert json.loads(health[0].body.to_pybytes())["ok"] is True
    return refused


# ---- JSON documents --------------------------------------------------------------------------------

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True),
    st.text(max_size=20), st.sampled_from(["", "\u00e9\u4e2d\U0001f600", "known", "\x00", "a" * 600]),
)
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=12)
_KINDS = ["metadata", "slices", "images", "weights", "put_group", "put_images", "put_weights", "nope", ""]
_FIELDS = ["since", "columns", "slices", "keys", "version", "group_id", "rows", "missing_ok", "extra"]


@st.composite
def documents(draw: st.DrawFn) -> bytes:
    """A near-valid document (right keys, wrong values), arbitrary JSON, raw bytes, or truncated JSON."""
    choice = draw(st.integers(0, 3))
    if choice == 0:
        return draw(st.binary(max_size=64))
    if choice == 1:
        return json.dumps(draw(_json)).encode()
    doc: dict[str, Any] = {"v": draw(st.one_of(st.just(2), _scalars)), "kind": draw(st.sampled_from(_KINDS))}
    for f in draw(st.lists(st.sampled_from(_FIELDS), max_size=3, unique=True)):
        doc[f] = draw(
            st.one_of(
                _json,
                st.lists(
                    st.fixed_dictionaries(
                        {"group_id": st.sampled_from(["known", "ghost", "\u00e9", ""]),
                         "start": st.integers(-5, 2**63), "stop": st.integers(-5, 2**63)}
                    ),
                    max_size=3,
                ),
                st.lists(st.sampled_from(["group_id", "reward", "seq", "bogus", "response_ids", "node"]), max_size=3),
            )
        )
    raw = json.dumps(doc).encode()
    if choice == 3:
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    return raw


def test_fuzzed_tickets(node) -> None:
    _, raw = node
    tally = _Tally()

    @SETTINGS
    @given(ticket=documents())
    def one(ticket: bytes) -> None:
        tally.add(_typed_or_ok("ticket", lambda: raw.do_get(flight.Ticket(ticket), OPTIONS).read_all(), raw))

    one()
    tally.check("ticket", mostly_refused=True)


def test_fuzzed_descriptors(node) -> None:
    _, raw = node
    puts, infos = _Tally(), _Tally()

    @SETTINGS
    @given(descriptor=documents())
    def one(descriptor: bytes) -> None:
        puts.add(_typed_or_ok("descriptor", lambda: _put(raw, descriptor, _group("fz", 2)), raw))
        infos.add(_typed_or_ok(
            "flight_info", lambda: raw.get_flight_info(flight.FlightDescriptor.for_command(descriptor), OPTIONS), raw
        ))

    one()
    puts.check("descriptor", mostly_refused=True)
    infos.check("flight_info", mostly_refused=False)


def test_fuzzed_action_bodies(node) -> None:
    server, raw = node
    tally = _Tally()

    @SETTINGS
    @given(action=st.sampled_from([*ACTION_DESCRIPTIONS, "drop_all", "", "\u00e9"]), body=documents())
    def one(action: str, body: bytes) -> None:
        if action == "release":  # keep the known group (other examples read it)
            body = body.replace(b"known", b"other")
        tally.add(_typed_or_ok("action", lambda: list(raw.do_action(flight.Action(action, body), OPTIONS)), raw))
        assert "known" in server.store.group_ids()

    one()
    tally.check("action", mostly_refused=False)


def test_fuzzed_read_channel_requests_and_descriptors(node) -> None:
    """A read channel answers every request with rows or an in-band project error and goes on; an exchange's
    descriptor is accepted or refused typed."""
    _, raw = node
    requests, opens = _Tally(), _Tally()
    long_lived = flight.FlightCallOptions(timeout=300)
    channel = json.dumps({"v": 3, "kind": "reads", "columns": ["group_id", "sample_idx"]}).encode()
    writer, reader = raw.do_exchange(flight.FlightDescriptor.for_command(channel), long_lived)
    writer.begin(pa.schema([]))

    def answer(w: Any, r: Any, request: bytes) -> dict[str, Any]:
        w.write_metadata(request)
        while True:
            chunk = r.read_chunk()
            if chunk.app_metadata is not None:
                return json.loads(chunk.app_metadata.to_pybytes())  # type: ignore[no-any-return]

    @SETTINGS
    @given(request=documents())
    def one(request: bytes) -> None:
        assume(request)  # an empty message reads as the stream's end: it ends the channel (docs/protocol.md)
        end = answer(writer, reader, request)
        if "error" in end:
            assert end["error"]["error"] in ERROR_CLASSES and end["error"]["message"], end  # never internal
        requests.add("error" in end)

    def open_and_read(descriptor: bytes) -> None:
        w, r = raw.do_exchange(flight.FlightDescriptor.for_command(descriptor), OPTIONS)
        try:
            w.begin(pa.schema([]))
            answer(w, r, json.dumps({"v": 3, "kind": "slices", "slices": [
                {"group_id": "known", "start": 0, "stop": 1}]}).encode())
            w.done_writing()
        finally:
            w.close()

    @SETTINGS
    @given(descriptor=documents())
    def opening(descriptor: bytes) -> None:
        opens.add(_typed_or_ok("exchange", lambda: open_and_read(descriptor), raw))

    one()
    assert answer(writer, reader, json.dumps({"v": 3, "kind": "slices", "columns": ["group_id", "sample_idx"],
                                              "slices": [{"group_id": "known", "start": 1, "stop": 3}]}).encode()) == {
        "rows": 2, "metadata": {"knittrans.schema_version": str(SCHEMA_VERSION), "knittrans.table": "trajectory"}}
    writer.done_writing()
    writer.close()
    opening()
    requests.check("read channel request", mostly_refused=True)
    opens.check("exchange descriptor", mostly_refused=True)


# ---- record batches --------------------------------------------------------------------------------

_BAD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "sample_idx": st.integers(-(2**31), 2**31 - 1),
    "policy_version": st.integers(-(2**63), 2**63 - 1),
    "prompt_len": st.integers(-(2**31), 2**31 - 1),
    "response_len": st.integers(-(2**31), 2**31 - 1),
    "reward": st.floats(width=32, allow_nan=True),
    "status": st.text(max_size=12),
    "group_id": st.text(max_size=12),
    "num_images": st.integers(-(2**15), 2**15 - 1),
}


@st.composite
def batches(draw: st.DrawFn) -> tuple[str, pa.Table]:
    """A valid group mutated: columns dropped / retyped / added, values out of range, nulls, unicode ids."""
    gid = draw(st.sampled_from(["fz", "\u00e9\u4e2d\U0001f600", "x" * 512, "known"]))
    table = pa.Table.from_batches([_group(gid, draw(st.integers(1, 4)))])
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["drop", "retype", "value", "null", "extra", "dup", "listlen"]))
        names = table.column_names
        i = draw(st.integers(0, len(names) - 1))  # by position: "dup" makes names ambiguous
        col, typ = names[i], table.schema.field(i).type
        if op == "drop":
            table = table.remove_column(i)
        elif op == "retype":
            table = table.set_column(i, col, pa.array([str(v) for v in table.column(i).to_pylist()]))
        elif op == "value" and col in _BAD_VALUES:
            vals = [draw(_BAD_VALUES[col]) for _ in range(table.num_rows)]
            table = table.set_column(i, pa.field(col, typ), pa.array(vals).cast(typ, safe=False)
                                     if col not in ("status", "group_id") else pa.array(vals))
        elif op == "null":
            table = table.set_column(i, col, pa.nulls(table.num_rows, typ))
        elif op == "extra":
            table = table.append_column(draw(st.sampled_from(["bogus", "\u00e9"])), pa.array([1] * table.num_rows))
        elif op == "dup":
            table = table.append_column(col, table.column(i))
        elif op == "listlen" and col in ("response_ids", "response_logprobs", "loss_mask", "prompt_ids"):
            table = table.set_column(i, col, pa.array([[0] * draw(st.integers(0, 5))] * table.num_rows).cast(typ))
    desc_gid = draw(st.sampled_from([gid, "other"]))
    return desc_gid, table


def test_fuzzed_record_batches(node) -> None:
    server, raw = node
    tally = _Tally()

    @SETTINGS
    @given(case=batches())
    def one(case: tuple[str, pa.Table]) -> None:
        gid, table = case
        desc = PutGroup(group_id=gid, rows=max(1, table.num_rows)).to_bytes()
        tally.add(_typed_or_ok("batch", lambda: _put(raw, desc, table), raw))
        assert "known" in server.store.group_ids()

    one()
    tally.check("batch", mostly_refused=True)
