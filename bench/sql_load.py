"""The write path under SQL load: ``put_groups`` latency on a node while dashboards query the Flight SQL gateway.

``python -m bench.sql_load [--quick] --out F.json``

A store node runs in a process of its own, and two ``knit sql`` gateways over it in processes of their own:
one sharing each read of the node among queries for ``snapshot_max_age_s = 1`` s (the default), one reading
the node again for every query (``0``: the worst a gateway can do to a node). ``--writers`` threads each call
``StoreWriter.put_groups`` with :data:`GROUPS_PER_CALL` groups, ``--calls`` times per phase, and time every
call. Phases, in interleaved repetitions (the order turning each repetition):

* ``quiet``: the writes alone (the gateways idle);
* ``cached`` / ``fresh``: the same writes while ``--clients`` ADBC clients run the documented metadata queries
  (:data:`QUERIES`: reward by policy version, staleness by task, tokens per node) back to back through the
  gateway of that name.

Metrics: p50 and p99 of the call latency per phase (all repetitions pooled), the queries answered per second
and their p50. Ratios: ``p50_cached_vs_quiet`` ... ``p99_fresh_vs_quiet``, each the loaded phase's percentile
over the quiet phase's, of the same calls of the same groups (1.0 = no effect on writes). The node holds
``--preload`` groups before the phases begin, so the queries scan a table of some size.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench._common import write_result
from bench.store_groups import make_group, start_store_process
from flight_store.writing import StoreWriter

GROUPS_PER_CALL = 4
"""Groups per ``put_groups`` call."""
QUERIES = (
    "SELECT policy_version, avg(reward) AS reward, count(*) AS n FROM trajectories GROUP BY 1 ORDER BY 1",
    "SELECT data_source, avg(v.version - policy_version_min) AS staleness FROM trajectories, "
    "(SELECT max(policy_version) AS version FROM nodes) v WHERE NOT released GROUP BY 1",
    "SELECT node, sum(prompt_len + response_len) AS tokens FROM trajectories GROUP BY node",
)
"""The documented example queries (docs/sql.md), run in turn by every query client."""
PHASES = ("quiet", "cached", "fresh")


def start_gateway(store: str, max_age_s: float, nice: int) -> tuple[subprocess.Popen[str], str]:
    """A ``knit sql`` process over ``store``; returns it and where it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "sql", "--stores", store,
                             "--snapshot-max-age-s", str(max_age_s), "--nice", str(nice)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = proc.stdout.readline() if proc.stdout is not None else ""
    if "listening on " not in line:
        proc.kill()
        msg = f"knit sql did not start: {line!r}"
        raise RuntimeError(msg)
    return proc, line.split("listening on ", 1)[1].strip()


def _query_loop(location: str, stop: threading.Event, times: list[float]) -> None:
    import adbc_driver_flightsql.dbapi as flightsql

    with flightsql.connect(location, autocommit=True) as conn, conn.cursor() as cur:
        i = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            cur.execute(QUERIES[i % len(QUERIES)])
            cur.fetch_arrow_table()
            times.append(time.perf_counter() - t0)
            i += 1


def _write_loop(writer: StoreWriter, calls: list[list[Any]], into: list[float]) -> None:
    for batches in calls:
        t0 = time.perf_counter()
        result = writer.put_groups(batches)
        into.append(time.perf_counter() - t0)
        if result.refused:
            msg = f"the node refused groups: {result.refused}"
            raise RuntimeError(msg)


def run_phase(writers: list[StoreWriter], make: Callable[[], list[Any]], calls: int, gateway: str | None,
              clients: int) -> tuple[list[float], list[float]]:
    """One phase: every writer's ``calls`` timed ``put_groups`` (queries running through ``gateway`` when given);
    returns the call latencies and the query latencies."""
    work = [[make() for _ in range(calls)] for _ in writers]
    latencies: list[list[float]] = [[] for _ in writers]
    query_times: list[list[float]] = [[] for _ in range(clients if gateway else 0)]
    stop = threading.Event()
    queriers = [threading.Thread(target=_query_loop, args=(gateway, stop, t)) for t in query_times]
    for q in queriers:
        q.start()
    while gateway and not all(query_times):  # every client has answered once: the load is on
        time.sleep(0.01)
    threads = [threading.Thread(target=_write_loop, args=(w, c, lat)) for w, c, lat in zip(writers, work, latencies,
                                                                                            strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    for q in queriers:
        q.join()
    return [x for lat in latencies for x in lat], [x for t in query_times for x in t]


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    counter = iter(range(1 << 40))

    def make() -> list[Any]:
        return [make_group(f"g{next(counter)}", args.size, args.tokens, rng) for _ in range(GROUPS_PER_CALL)]

    node = start_store_process()
    gateways: dict[str, tuple[subprocess.Popen[str], str]] = {}
    try:
        gateways = {"cached": start_gateway(node.location, 1.0, args.nice),
                    "fresh": start_gateway(node.location, 0.0, args.nice)}
        writers = [StoreWriter(node.location) for _ in range(args.writers)]
        for _ in range(args.preload // GROUPS_PER_CALL):
            writers[0].put_groups(make())
        lat: dict[str, list[float]] = {p: [] for p in PHASES}
        qlat: dict[str, list[float]] = {p: [] for p in PHASES}
        qtime: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        run_phase(writers, make, max(2, args.calls // 4), None, 0)  # warm-up, not counted
        for rep in range(args.reps):
            order = PHASES if rep % 2 == 0 else PHASES[::-1]
            for phase in order:
                t0 = time.perf_counter()
                calls, queries = run_phase(writers, make, args.calls, gateways[phase][1] if phase in gateways else None,
                                           args.clients)
                qtime[phase] += time.perf_counter() - t0
                lat[phase] += calls
                qlat[phase] += queries
        for w in writers:
            w.close()
    finally:
        for proc, _ in gateways.values():
            proc.terminate()
            proc.wait(timeout=30)
        node.stop()
    metrics: dict[str, Any] = {}
    for p in PHASES:
        metrics[f"put_groups_p50_ms_{p}"] = float(np.percentile(lat[p], 50) * 1e3)
        metrics[f"put_groups_p99_ms_{p}"] = float(np.percentile(lat[p], 99) * 1e3)
        metrics[f"put_groups_calls_{p}"] = len(lat[p])
        if p in gateways:
            metrics[f"queries_per_s_{p}"] = len(qlat[p]) / qtime[p]
            metrics[f"query_p50_ms_{p}"] = float(np.percentile(qlat[p], 50) * 1e3)
    ratios = {f"{q}_{p}_vs_quiet": metrics[f"put_groups_{q}_ms_{p}"] / metrics[f"put_groups_{q}_ms_quiet"]
              for p in gateways for q in ("p50", "p99")}
    return {"metrics": metrics, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sql_load", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and repetitions")
    parser.add_argument("--out", default="results/sql_load.json")
    parser.add_argument("--writers", type=int, default=4, help="concurrent put_groups callers")
    parser.add_argument("--clients", type=int, default=2, help="concurrent ADBC query clients in a loaded phase")
    parser.add_argument("--calls", type=int, default=None, help="put_groups calls per writer per phase (60; quick 20)")
    parser.add_argument("--reps", type=int, default=None, help="interleaved repetitions (4; quick 2)")
    parser.add_argument("--preload", type=int, default=2000, help="groups stored before the phases")
    parser.add_argument("--size", type=int, default=8, help="trajectories per group (G)")
    parser.add_argument("--tokens", type=int, default=512, help="response tokens per trajectory")
    parser.add_argument("--nice", type=int, default=10, help="the gateways' niceness (knit sql --nice; 0 = none)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.calls = args.calls or (20 if args.quick else 60)
    args.reps = args.reps or (2 if args.quick else 4)
    result = run(args)
    params = {k: v for k, v in vars(args).items() if k != "out"} | {
        "groups_per_call": GROUPS_PER_CALL, "queries": list(QUERIES), "cpus": os.cpu_count(),
        "transport": "loopback; node and both gateways in processes of their own"}
    write_result(args.out, result["metrics"], result["ratios"], params)
    m, r = result["metrics"], result["ratios"]
    for p in PHASES:
        qps = m.get(f"queries_per_s_{p}")
        extra = "" if qps is None else f", {qps:.1f} queries/s (p50 {m[f'query_p50_ms_{p}']:.0f} ms)"
        print(f"{p:>6}: put_groups p50 {m[f'put_groups_p50_ms_{p}']:.2f} ms, p99 {m[f'put_groups_p99_ms_{p}']:.2f} ms"
              f"{extra}")
    print("ratios " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
