"""The write path: ``put_group`` into a store node beside a minimal Flight DoPut of the same batches.

``python -m bench.write_path [--quick] --out F.json``

Both servers run in processes of their own on loopback: a ``knit serve`` node (no spill log, no
budget) and a minimal pyarrow Flight server whose DoPut reads the stream and keeps its batches (no
validation, no copy, no metadata: the floor a Flight write cannot go below). The client writes the
same groups (G trajectories of ``--tokens`` response tokens, all 19 columns, as ``StoreWriter``
users send them) one DoPut per group to each, in interleaved repetitions, and reports throughput
(payload GB/s) and the time per group; ``ratios.put_vs_minimal_flight`` is the node's throughput over
the floor's (the node's validation included; target >= 0.8 in ``bench.peers``): the same groups, one DoPut
each, the servers taking turns per repetition, medians over repetitions. Then the bulk write: other
groups of the same shape in DoPuts of :data:`BULK` groups each (``StoreWriter.put_groups``, each group
still validated and committed on its own) beside DoPuts of the same batches to the minimal server
(``ratios.put_groups_vs_minimal_flight_bulk``; ``ratios.put_groups_vs_put_group``: the bulk write's
gain). ``metrics.server_us_per_group`` is ``Store.put_group`` in-process on the same groups: the
node's own time per group, without gRPC; ``metrics.server_us_per_group_bulk`` the same for
``Store.put_groups`` in calls of :data:`BULK` groups (the rules checked once per call).

A third server takes its turn on the same groups: the minimal server with ``own_pages``
(:mod:`bench.minimal_flight`), which copies each received batch into pages of its own as the node does
and checks and indexes nothing: the floor of a store that owns its memory.
``ratios.put_vs_minimal_flight_own_pages`` is the node's throughput over that floor (what the rule
check, the group table and the node's protocol cost), ``ratios.minimal_own_pages_vs_minimal_flight``
that floor's over the minimal one's (what owning the memory costs); both diagnostics.
Where the node's gap sits, part by part: :mod:`bench.write_parts`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from bench import minimal_flight
from bench._common import write_result
from bench.store_groups import make_group, start_store_process
from flight_store.store import Store, StoreConfig
from flight_store.writing import StoreWriter

BULK = 32
"""Groups per bulk DoPut (``put_groups``), and per DoPut of the same batches to the minimal server."""


def interleaved(writes: dict[str, Callable[[Any], object]], items: Sequence[Any], rep: int,
                 into: dict[str, list[float]]) -> None:
    """Each write over all ``items`` in turn (the order rotating with ``rep``, so each takes every place), its seconds
    added to ``into``."""
    names = list(writes)
    k = rep % len(names)
    for name in names[k:] + names[:k]:
        t0 = time.perf_counter()
        for item in items:
            writes[name](item)
        into[name].append(time.perf_counter() - t0)


def _server_us_per_group(groups: list[pa.RecordBatch]) -> float:
    """``Store.put_group`` in-process over ``groups`` (the first tenth warms up), microseconds per group."""
    store = Store(StoreConfig())
    warm = max(1, len(groups) // 10)
    for g in groups[:warm]:
        store.put_group(str(g.column("group_id")[0]), [g])
    t0 = time.perf_counter()
    for g in groups[warm:]:
        store.put_group(str(g.column("group_id")[0]), [g])
    us = (time.perf_counter() - t0) / (len(groups) - warm) * 1e6
    store.close()
    return us


def _server_us_per_group_bulk(groups: list[pa.RecordBatch]) -> float:
    """``Store.put_groups`` in-process over ``groups`` in calls of :data:`BULK` (the first call warms up),
    microseconds per group."""
    store = Store(StoreConfig())
    calls = [groups[i:i + BULK] for i in range(0, len(groups), BULK)]

    def one(call: list[pa.RecordBatch]) -> None:
        with store.incoming(f"{len(call)} groups") as incoming:
            incoming.add(sum(b.get_total_buffer_size() for b in call))
            stored, refused = store.put_groups([(str(b.column("group_id")[0]), b.num_rows) for b in call], call,
                                               incoming=incoming)
        if refused or len(stored) != len(call):
            msg = f"the bulk write refused {sorted(refused)}"
            raise RuntimeError(msg)

    one(calls[0])
    t0 = time.perf_counter()
    for call in calls[1:]:
        one(call)
    us = (time.perf_counter() - t0) / sum(len(c) for c in calls[1:]) * 1e6
    store.close()
    return us


def run(groups_n: int, size: int, tokens: int, reps: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    payload = make_group("g", size, tokens, rng).nbytes
    node = start_store_process()
    sinks = {"minimal": minimal_flight.start(), "own_pages": minimal_flight.start(own_pages=True)}
    times: dict[str, list[float]] = {"knit": [], "minimal": [], "own_pages": [], "bulk": [], "bulk_minimal": []}
    try:
        with StoreWriter(node.location) as client:
            raw = flight.connect(sinks["minimal"][1])
            own = flight.connect(sinks["own_pages"][1])
            for rep in range(reps):
                groups = [make_group(f"r{rep}g{i}", size, tokens, rng) for i in range(groups_n)]

                interleaved({"knit": client.put_group,
                              "minimal": lambda g: minimal_flight.put(raw, str(g.column("group_id")[0]), g),
                              "own_pages": lambda g: minimal_flight.put(own, str(g.column("group_id")[0]), g)},
                             groups, rep, times)
                fresh = [make_group(f"r{rep}b{i}", size, tokens, rng) for i in range(groups_n)]
                interleaved({"bulk": client.put_groups,
                              "bulk_minimal": lambda c: minimal_flight.put(raw, str(c[0].column("group_id")[0]),
                                                                            pa.Table.from_batches(c))},
                             [fresh[i:i + BULK] for i in range(0, groups_n, BULK)], rep, times)
            raw.close()
            own.close()
    finally:
        node.stop()
        for proc, _ in sinks.values():
            proc.kill()
            proc.wait(timeout=10)
    server_us = _server_us_per_group([make_group(f"s{i}", size, tokens, rng) for i in range(groups_n)])
    server_us_bulk = _server_us_per_group_bulk([make_group(f"u{i}", size, tokens, rng)
                                                for i in range(max(groups_n, 2 * BULK))])
    gbps = {name: groups_n * payload / statistics.median(ts) / 1e9 for name, ts in times.items()}
    ms = {name: statistics.median(ts) / groups_n * 1e3 for name, ts in times.items()}
    return {
        "metrics": {
            "put_group_gbps": gbps["knit"], "minimal_flight_put_gbps": gbps["minimal"],
            "put_group_ms_per_group": ms["knit"], "minimal_flight_ms_per_group": ms["minimal"],
            "minimal_flight_own_pages_gbps": gbps["own_pages"],
            "minimal_flight_own_pages_ms_per_group": ms["own_pages"],
            "server_us_per_group": server_us, "server_us_per_group_bulk": server_us_bulk, "group_bytes": payload,
            "put_group_s_per_rep": times["knit"], "minimal_flight_s_per_rep": times["minimal"],
            "put_groups_gbps": gbps["bulk"], "minimal_flight_bulk_gbps": gbps["bulk_minimal"],
            "put_groups_ms_per_group": ms["bulk"], "bulk_groups_per_doput": BULK,
        },
        "ratios": {"put_vs_minimal_flight": gbps["knit"] / gbps["minimal"],
                   "put_vs_minimal_flight_own_pages": gbps["knit"] / gbps["own_pages"],
                   "minimal_own_pages_vs_minimal_flight": gbps["own_pages"] / gbps["minimal"],
                   "put_groups_vs_minimal_flight_bulk": gbps["bulk"] / gbps["bulk_minimal"],
                   "put_groups_vs_put_group": gbps["bulk"] / gbps["knit"]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.write_path", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer groups per repetition")
    parser.add_argument("--out", default="results/write_path.json")
    parser.add_argument("--groups", type=int, default=None, help="groups per repetition (400; quick 150)")
    parser.add_argument("--size", type=int, default=8, help="trajectories per group (G)")
    parser.add_argument("--tokens", type=int, default=2048, help="response tokens per trajectory")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions (medians reported)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    groups_n = args.groups or (150 if args.quick else 400)
    result = run(groups_n, args.size, args.tokens, args.reps, args.seed)
    params = {"quick": args.quick, "groups": groups_n, "size": args.size, "tokens": args.tokens, "reps": args.reps,
              "seed": args.seed, "transport": "loopback, one DoPut per group, servers in processes of their own"}
    write_result(args.out, result["metrics"], result["ratios"], params)
    m = result["metrics"]
    print(f"put_groups {m['put_groups_gbps']:.3f} GB/s vs minimal Flight {m['minimal_flight_bulk_gbps']:.3f} GB/s "
          f"in DoPuts of {BULK} groups ({result['ratios']['put_groups_vs_minimal_flight_bulk']:.2f})")
    print(f"put_group {m['put_group_gbps']:.3f} GB/s ({m['put_group_ms_per_group']:.2f} ms/group), minimal Flight "
          f"{m['minimal_flight_put_gbps']:.3f} GB/s ({m['minimal_flight_ms_per_group']:.2f} ms/group); ratio "
          f"{result['ratios']['put_vs_minimal_flight']:.2f}; server {m['server_us_per_group']:.0f} us/group in-process "
          f"({m['server_us_per_group_bulk']:.0f} in bulk)")
    print(f"minimal Flight copying into pages of its own {m['minimal_flight_own_pages_ms_per_group']:.2f} ms/group: "
          f"{result['ratios']['minimal_own_pages_vs_minimal_flight']:.2f} of the minimal one; put_group "
          f"{result['ratios']['put_vs_minimal_flight_own_pages']:.2f} of it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
