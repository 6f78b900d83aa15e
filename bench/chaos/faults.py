"""The faults a chaos run injects, each a function of the run's :class:`Target`: what it did, as one :class:`Fault`.

Process faults SIGKILL a child of the launcher by the pid its ``logs/children.json`` records (a store node, the
rollout) or the launcher itself. Network faults take a store host's link down (:class:`launcher.hosts.Host`): for
a while, or for good. Hostile clients come from this process, over the bridge, at a store node's address: idle
DoPuts on connections of their own, malformed DoPuts (a wrong schema, rows that lie about their count, garbage
where Arrow IPC belongs), and a reader that stops reading mid-stream. A malformed put a node accepts is recorded
(``accepted``): the run's invariants count it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from bench.store_groups import make_group
from schemas.routing import home_id

KINDS = ("store_kill", "link_cut", "store_lost", "rollout_kill", "idle_connections", "malformed_puts",
         "stalled_reader", "launcher_kill")
"""Every fault kind (``metrics.faults_<kind>`` counts each)."""


@dataclass(kw_only=True)
class Fault:
    """One fault injected."""

    kind: str
    at: float
    """Unix time it was injected."""
    target: str
    detail: dict[str, Any] = field(default_factory=dict)
    accepted: int = 0
    """Malformed puts a node took (each breaks an invariant)."""
    unreached: int = 0
    """Malformed puts that never reached a node (it was down): they tested nothing."""


@dataclass(kw_only=True)
class Target:
    """What the faults act on: the run folder, the store hosts, the launcher, and which hosts are cut now."""

    out: Path
    store_hosts: list[Any]
    """``launcher.hosts.Host`` of store node ``i``."""
    launcher_pid: Callable[[], int]
    """The running launcher's pid (0 while none runs)."""
    restart_launcher: Callable[[], None]
    """Start the launcher again with ``--resume`` (after it was killed)."""
    cut_until: dict[int, float] = field(default_factory=dict)
    """Store index -> Unix time its link comes back (``inf``: lost for good)."""
    holders: list[threading.Thread] = field(default_factory=list)
    """Threads holding idle calls open (joined at the end)."""

    def child_pid(self, name: str) -> int:
        """The pid the launcher recorded for its child ``name`` (0: none yet)."""
        try:
            children = json.loads((self.out / "logs" / "children.json").read_text())
        except (OSError, ValueError):
            return 0
        return next((int(c["pid"]) for c in children if c["name"] == name), 0)

    def live_stores(self) -> list[int]:
        """Store indices whose link is up."""
        return [i for i in range(len(self.store_hosts)) if i not in self.cut_until]

    def location(self, i: int) -> str:
        """Store node ``i``'s address, from its config document."""
        doc = json.loads((self.out / "configs" / f"store{i}.json").read_text())
        return f"grpc://{doc['host']}:{doc['port']}"

    def restore_due(self, now: float) -> list[int]:
        """Bring back the links whose cut has run out; returns their store indices."""
        due = [i for i, t in self.cut_until.items() if t <= now and t != float("inf")]
        for i in due:
            self.store_hosts[i].restore()
            del self.cut_until[i]
        return due

    def end_cuts(self) -> None:
        """Bring back every link cut for a while (a host lost for good stays cut off)."""
        self.restore_due(float("inf"))

    def restore_all(self) -> None:
        """Every cut link up again (lost hosts too: the run is over)."""
        for i in list(self.cut_until):
            self.store_hosts[i].restore()
        self.cut_until.clear()


def _kill(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def store_kill(t: Target, rng: random.Random, quick: bool) -> Fault | None:
    """SIGKILL a store node's process (the launcher starts it again from its spill log)."""
    live = t.live_stores()
    i = rng.choice(live) if live else 0
    pid = t.child_pid(f"store{i}")
    return Fault(kind="store_kill", at=time.time(), target=f"store{i}", detail={"pid": pid}) if _kill(pid) else None


def link_cut(t: Target, rng: random.Random, quick: bool) -> Fault | None:
    """Take a store host's link down for 5-60 s (5-30 with ``quick``), past a call timeout included."""
    live = t.live_stores()
    if len(live) < 2:
        return None
    i = rng.choice(live)
    seconds = rng.uniform(5.0, 30.0 if quick else 60.0)
    t.store_hosts[i].cut()
    t.cut_until[i] = time.time() + seconds
    return Fault(kind="link_cut", at=time.time(), target=f"store{i}", detail={"seconds": round(seconds, 1)})


def store_lost(t: Target, rng: random.Random, quick: bool) -> Fault | None:
    """Cut a store host off for good (at most one of the run's hosts: the others carry on)."""
    if any(v == float("inf") for v in t.cut_until.values()) or len(t.live_stores()) < len(t.store_hosts):
        return None
    i = rng.choice(t.live_stores())
    t.store_hosts[i].cut()
    t.cut_until[i] = float("inf")
    return Fault(kind="store_lost", at=time.time(), target=f"store{i}")


def rollout_kill(t: Target, rng: random.Random, quick: bool) -> Fault | None:
    """SIGKILL the rollout worker (the launcher takes the run up again, its prompts regenerated)."""
    pid = t.child_pid("rollout")
    return Fault(kind="rollout_kill", at=time.time(), target="rollout", detail={"pid": pid}) if _kill(pid) else None


def launcher_kill(t: Target, rng: random.Random, quick: bool) -> Fault | None:
    """SIGKILL the launcher (its children die with it), then start it again with ``--resume``."""
    pid = t.launcher_pid()
    if not _kill(pid):
        return None
    fault = Fault(kind="launcher_kill", at=time.time(), target="launcher", detail={"pid": pid})
    t.restart_launcher()
    return fault


def idle_connections(t: Target, rng: random.Random, quick: bool) -> Fault | None:
    """100-300 connections to one node, each holding an idle DoPut for 5-20 s."""
    live = t.live_stores()
    if not live:
        return None
    i, n, hold_s = rng.choice(live), rng.randint(100, 300), rng.uniform(5.0, 20.0)
    location = t.location(i)
    schema = make_group("idle", 1, 4, np.random.default_rng(0)).schema
    held: list[tuple[flight.FlightClient, Any]] = []
    opened_errors = 0
    for k in range(n):
        client = flight.connect(location)
        try:
            descriptor = flight.FlightDescriptor.for_command(json.dumps(
                {"v": 3, "kind": "put_group", "group_id": home_id(f"node{i}", f"chaos-idle-{k}"), "rows": 1}).encode())
            held.append((client, client.do_put(descriptor, schema, options=flight.FlightCallOptions(timeout=60.0))))
        except (flight.FlightError, OSError):
            opened_errors += 1
            client.close()

    def hold() -> None:
        time.sleep(hold_s)
        for client, _ in held:
            client.close()

    thread = threading.Thread(target=hold, name="chaos-idle", daemon=True)
    thread.start()
    t.holders.append(thread)
    return Fault(kind="idle_connections", at=time.time(), target=f"store{i}",
                 detail={"connections": n, "held_s": round(hold_s, 1), "refused_at_open": opened_errors})


UNREACHED = "FlightUnavailableError"
"""What a malformed put gets from a node that is down or still starting (a restart under way): it tested nothing."""


def _put(location: str, group_id: str, rows: int, table: pa.Table) -> str | None:
    """A DoPut of ``table`` declared as ``rows`` rows of ``group_id``: None if the node took it, else its error."""
    client = flight.connect(location)
    try:
        descriptor = flight.FlightDescriptor.for_command(json.dumps(
            {"v": 3, "kind": "put_group", "group_id": group_id, "rows": rows}).encode())
        writer, reader = client.do_put(descriptor, table.schema, options=flight.FlightCallOptions(timeout=10.0))
        writer.write_table(table)
        writer.done_writing()
        reader.read()
        writer.close()
    except (flight.FlightError, pa.ArrowException, OSError) as exc:
        return type(exc).__name__
    finally:
        client.close()
    return None


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field."""
    def varint(v: int) -> bytes:
        out = bytearray()
        while True:
            byte, v = v & 0x7F, v >> 7
            out.append(byte | (0x80 if v else 0))
            if not v:
                return bytes(out)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def flight_data(descriptor: bytes | None, header: bytes, body: bytes = b"") -> bytes:
    """A ``FlightData`` message (Flight.proto: descriptor 1, data_header 2, data_body 1000) as bytes: what a raw
    gRPC client sends where pyarrow's client would refuse to."""
    cmd = _field(2, descriptor) if descriptor is not None else b""
    described = _field(1, b"\x08\x02" + cmd) if descriptor is not None else b""  # FlightDescriptor type CMD = 2
    return described + _field(2, header) + (_field(1000, body) if body else b"")


def raw_put(location: str, messages: list[bytes], timeout_s: float = 10.0) -> str | None:
    """A DoPut of raw ``FlightData`` ``messages`` over a gRPC channel of its own: None if it ended well, else the
    status it ended with, ``"<CODE>: <details>"`` (``UNAVAILABLE: ...`` when no node took the call)."""
    import grpc  # the dev extra's

    channel = grpc.insecure_channel(location.removeprefix("grpc://"))
    do_put = channel.stream_stream("/arrow.flight.protocol.FlightService/DoPut",
                                   request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        list(do_put(iter(messages), timeout=timeout_s))
    except grpc.RpcError as exc:
        return f"{exc.code().name}: {exc.details()}"
    finally:
        channel.close()
    return None


def _garbage_ipc(location: str, group_id: str, table: pa.Table) -> str | None:
    """A DoPut of ``table``'s schema, then a message that is not Arrow IPC."""
    doc = json.dumps({"v": 3, "kind": "put_group", "group_id": group_id, "rows": table.num_rows}).encode()
    schema_header = pa.ipc.read_message(table.schema.serialize()).metadata.to_pybytes()
    answer = raw_put(location, [flight_data(doc, schema_header), flight_data(None, b"\xfe" * 32, b"\x01" * 64)])
    if answer is None:
        return None
    return UNREACHED if answer.startswith("UNAVAILABLE:") else "refused: " + answer[:80]


def malformed_puts(t: Target, rng: random.Random, quick: bool) -> Fault | None:
    """Three DoPuts a node must refuse: a wrong schema, rows that lie about their count, a message that is not
    Arrow IPC (from a raw gRPC client). Group ids no prompt has: one a node took would show in the ledger check
    too."""
    live = t.live_stores()
    if not live:
        return None
    i = rng.choice(live)
    location = t.location(i)
    tag = home_id(f"node{i}", f"chaos-bad-{int(time.time() * 1000)}")  # owned by the node: refused for what it is
    good = make_group(f"{tag}-b", 4, 8, np.random.default_rng(rng.randrange(1 << 30)))
    answers = {
        "wrong_schema": _put(location, f"{tag}-a", 2, pa.table({"x": [1, 2]})),
        "rows_lie": _put(location, f"{tag}-b", 5, pa.Table.from_batches([good])),
        "garbage_ipc": _garbage_ipc(location, f"{tag}-c", pa.Table.from_batches([good])),
    }
    return Fault(kind="malformed_puts", at=time.time(), target=f"store{i}", detail=answers,
                 accepted=sum(a is None for a in answers.values()),
                 unreached=sum(a == UNREACHED for a in answers.values()))


def stalled_reader(t: Target, rng: random.Random, quick: bool) -> Fault | None:
    """A metadata DoGet whose reader takes one batch and then stops reading for 5-20 s."""
    live = t.live_stores()
    if not live:
        return None
    i, hold_s = rng.choice(live), rng.uniform(5.0, 20.0)
    client = flight.connect(t.location(i))
    try:
        reader = client.do_get(flight.Ticket(json.dumps({"v": 3, "kind": "metadata", "since": 0}).encode()),
                               options=flight.FlightCallOptions(timeout=60.0))
        reader.read_chunk()
    except (flight.FlightError, OSError, StopIteration) as exc:
        client.close()
        return Fault(kind="stalled_reader", at=time.time(), target=f"store{i}", detail={"error": type(exc).__name__})

    def hold() -> None:
        time.sleep(hold_s)
        client.close()

    thread = threading.Thread(target=hold, name="chaos-reader", daemon=True)
    thread.start()
    t.holders.append(thread)
    return Fault(kind="stalled_reader", at=time.time(), target=f"store{i}", detail={"held_s": round(hold_s, 1)})


INJECT: dict[str, Callable[[Target, random.Random, bool], Fault | None]] = {
    "store_kill": store_kill, "link_cut": link_cut, "store_lost": store_lost, "rollout_kill": rollout_kill,
    "idle_connections": idle_connections, "malformed_puts": malformed_puts, "stalled_reader": stalled_reader,
    "launcher_kill": launcher_kill,
}
"""Fault kind -> its injector (None when it had nothing to act on: the fault is drawn again later)."""
