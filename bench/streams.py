"""How many held calls a node carries before gRPC itself refuses, and what honest clients get meanwhile.

``python -m bench.streams [--quick] --out F.json``

A store node runs in its own process (``knit serve``'s defaults). This process opens connections step by step,
each holding one call that the node serves on a thread of its own until the client moves:

* ``read_channel``: a read channel (DoExchange) that never sends a request; its handler waits for one;
* ``put``: a DoPut that never sends a batch; past ``max_writers`` each new one takes the slot of the one idle
  longest (``write_evict_idle_s``), and the one it evicted stays blocked in gRPC until its client moves.

After each step an honest writer puts a group (a 2 s call deadline, its retries inside 2 s), an honest reader
reads it back, and ``stats`` answers; the node's threads and resident memory come from ``/proc``. A step where a
call fails records what gRPC answered, verbatim, and ends that kind's run (``metrics.streams_<kind>_held_max``:
the most calls held with every honest call answered). The held calls end when their connections close.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from bench._common import write_result
from bench.store_groups import make_group
from flight_store.config import ServerConfig
from flight_store.node import NodeProcess
from flight_store.writing import StoreWriter

KINDS = ("read_channel", "put")
STEPS = (100, 300, 1000, 2000, 4000, 8000)
QUICK_STEPS = (100, 300, 1000)
SETTLE_S = 20.0
"""Seconds a step waits for the node's threads to show every held call."""


def _proc(pid: int) -> dict[str, int]:
    """The node process's threads and resident memory (bytes)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"threads": int(fields["Threads"]), "rss": int(fields["VmRSS"].split()[0]) * 1024}


def _hold(location: str, kind: str, i: int, schema: pa.Schema) -> tuple[flight.FlightClient, Any]:
    """A new connection holding one idle call of ``kind``."""
    client = flight.connect(location)
    if kind == "read_channel":
        descriptor = flight.FlightDescriptor.for_command(json.dumps({"v": 3, "kind": "reads"}).encode())
        return client, client.do_exchange(descriptor)
    descriptor = flight.FlightDescriptor.for_command(
        json.dumps({"v": 3, "kind": "put_group", "group_id": f"idle{i}", "rows": 1}).encode())
    return client, client.do_put(descriptor, schema)


def _honest(location: str, step: int, rng: np.random.Generator) -> dict[str, Any]:
    """An honest put, its read back and a ``stats`` call: each one's seconds, or the error it got."""
    out: dict[str, Any] = {}
    group = make_group(f"honest{step}", 8, 256, rng)
    t0 = time.perf_counter()
    try:
        with StoreWriter(location, timeout=2.0, retries=3, backoff=0.25) as writer:
            writer.put_group(pa.Table.from_batches([group]))
        out["put_s"] = time.perf_counter() - t0
        client = flight.connect(location)
        t0 = time.perf_counter()
        options = flight.FlightCallOptions(timeout=5.0)
        descriptor = flight.FlightDescriptor.for_command(
            json.dumps({"v": 3, "kind": "group", "group_id": f"honest{step}"}).encode())
        info = client.get_flight_info(descriptor, options)
        rows = client.do_get(info.endpoints[0].ticket, options).read_all().num_rows
        out["read_s"], out["read_rows"] = time.perf_counter() - t0, rows
        t0 = time.perf_counter()
        stats = json.loads(next(iter(client.do_action(flight.Action("stats", b""), options))).body.to_pybytes())
        out["stats_s"], out["writers"], out["writes_evicted"] = (time.perf_counter() - t0, stats["writers"],
                                                                 stats["writes_evicted"])
        client.close()
    except (flight.FlightError, OSError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def run_kind(kind: str, steps: Sequence[int], seed: int) -> dict[str, Any]:
    """One node, ``kind``'s held calls grown step by step; each step's record."""
    rng = np.random.default_rng(seed)
    schema = make_group("x", 1, 1, rng).schema
    records: list[dict[str, Any]] = []
    held: list[tuple[flight.FlightClient, Any]] = []
    with NodeProcess(ServerConfig(log_level="ERROR")) as node:
        base = _proc(node.proc.pid)
        try:
            for step in steps:
                record: dict[str, Any] = {"held": step}
                try:
                    while len(held) < step:
                        held.append(_hold(node.location, kind, len(held), schema))
                except (flight.FlightError, OSError) as exc:
                    record["open_error"] = f"{type(exc).__name__}: {exc}"
                record["opened"] = len(held)
                deadline = time.monotonic() + SETTLE_S
                while (_proc(node.proc.pid)["threads"] - base["threads"] < min(len(held), step)
                       and time.monotonic() < deadline and kind == "read_channel"):
                    time.sleep(0.2)
                record.update(_proc(node.proc.pid))
                record["honest"] = _honest(node.location, step, rng)
                records.append(record)
                print(f"{kind}: {record}", flush=True)
                if "open_error" in record or "error" in record["honest"]:
                    break
        finally:
            for client, call in held:  # end each held call, then its connection (a refused call raises here)
                with contextlib.suppress(flight.FlightError, OSError):
                    call[0].close()
                client.close()
    ok = [r["held"] for r in records if "open_error" not in r and "error" not in r["honest"]]
    return {"base": base, "steps": records, "held_max": max(ok, default=0),
            "refused": next(({"held": r["held"], "answer": r.get("open_error") or r["honest"]["error"]}
                             for r in records if "open_error" in r or "error" in r["honest"]), None)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.streams", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"steps up to {QUICK_STEPS[-1]} held calls")
    parser.add_argument("--out", required=True, help="result JSON")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(list(argv) if argv is not None else None)
    steps = QUICK_STEPS if args.quick else STEPS
    runs = {kind: run_kind(kind, steps, args.seed) for kind in KINDS}
    metrics: dict[str, Any] = {}
    for kind, run in runs.items():
        metrics[f"streams_{kind}_held_max"] = run["held_max"]
        last = run["steps"][-1]
        metrics[f"streams_{kind}_threads_per_call"] = ((last["threads"] - run["base"]["threads"]) / last["held"])
        metrics[f"streams_{kind}_rss_per_call"] = (last["rss"] - run["base"]["rss"]) / last["held"]
        puts = [s["honest"]["put_s"] for s in run["steps"] if "put_s" in s["honest"]]
        metrics[f"streams_{kind}_honest_put_s_max"] = max(puts, default=None)
    params = {"steps": list(steps), "kinds": list(KINDS), "node": "knit serve defaults (max_writers 64, "
              "max_writers_per_peer 16, write_evict_idle_s 1)", "honest_put": "2 s call deadline, 3 retries "
              "(0.25, 0.5, 1 s)", "refused": {k: r["refused"] for k, r in runs.items()}}
    write_result(args.out, metrics, {}, params, raw=runs)
    for key in sorted(metrics):
        print(f"{key}: {metrics[key]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
