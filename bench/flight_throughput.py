"""Flight data-plane throughput: DoGet vs memcpy, metadata scans vs payload size, micro-batch latency.

``python -m bench.flight_throughput [--quick] [--hosts] --out results/flight_throughput.json``

``--hosts``: every store node runs in one host and this benchmark in another (network namespaces on a
bridge, see ``bench._hosts``), so each byte crosses a real network stack (veth) instead of loopback;
``params.network`` records the mode. Needs root; without it ``--hosts`` exits 2 saying why.

In one run:

(a) DoGet of micro-batch slices (8 trajectories each) totalling >= 256 MiB (quick: 64 MiB) per
    pass, best of 3 passes, from a store node in ANOTHER PROCESS (``python -m flight_store --config``
    on a free port), against the baseline: copying the same bytes in-process into newly
    allocated buffers, both kept alive for the pass. The headline is the trainer's path,
    ``StoreReader.stream`` (one read per micro-batch over the node's read channel, read in order);
    ``doget_per_call_gbps`` is one ``StoreReader.fetch`` per micro-batch, each followed by its copy.
    All of (a) runs in a child process with the system allocator and a fixed mmap threshold, so every
    buffer on BOTH sides
    is fresh memory (first-touch pages; the heap below that threshold is recycled normally, see
    ``FRESH_MEMORY_ENV``);
    ``*_pool_gbps`` repeats it in this process with the default Arrow pool (recycled, hot pages);
(b) the time of a full metadata scan when every row carries 1 KiB of payload, against 256 KiB
    per row, same row count (the metadata log never touches payload, so the ratio should be ~1);
(c) p50/p99 latency of fetching one micro-batch of 8 trajectories (8 groups, one row each) from a
    store holding >= 4096 groups.

Targets (quick mode): ratios.doget_vs_copy >= 0.5, ratios.meta_scan_large_vs_small <= 1.5,
metrics.microbatch_fetch_ms_p50 <= 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench._common import pyplot, timer, write_result
from bench._hosts import network_mode, run_in_hosts, start_node
from flight_store.config import ServerConfig, StoreConfig
from flight_store.node import NodeProcess
from flight_store.reading import StoreReader
from flight_store.server import StoreServer
from flight_store.writing import StoreWriter
from schemas.arrow import TRAJECTORY_SCHEMA
from schemas.plan import PlannedSlice

MIB = 1 << 20
BYTES_PER_TOKEN = 9  # response_ids int32 + response_logprobs float32 + loss_mask uint8


def make_group(group_id: str, size: int, response_tokens: int, rng: np.random.Generator) -> pa.RecordBatch:
    """A trajectory batch built straight from numpy (fast; no per-row Python objects)."""
    n_tok = size * response_tokens
    offsets = pa.array(np.arange(0, n_tok + 1, response_tokens, dtype=np.int32))
    prompt = 16
    p_offsets = pa.array(np.arange(0, size * prompt + 1, prompt, dtype=np.int32))
    now = np.datetime64("2026-01-01T00:00:00", "us")
    cols = {
        "group_id": pa.array([group_id] * size),
        "sample_idx": pa.array(np.arange(size, dtype=np.int32)),
        "policy_version": pa.array(np.zeros(size, dtype=np.int64)),
        "policy_version_min": pa.array(np.zeros(size, dtype=np.int64)),
        "data_source": pa.array(["bench"] * size),
        "prompt_len": pa.array(np.full(size, prompt, dtype=np.int32)),
        "response_len": pa.array(np.full(size, response_tokens, dtype=np.int32)),
        "reward": pa.array(rng.random(size, dtype=np.float32)),
        "finish_reason": pa.array(["stop"] * size),
        "status": pa.array(["completed"] * size),
        "num_images": pa.array(np.zeros(size, dtype=np.int16)),
        "num_turns": pa.array(np.ones(size, dtype=np.int16)),
        "loss_tokens": pa.array(np.full(size, response_tokens, dtype=np.int32)),
        "created_at": pa.array(np.full(size, now)),
        "completed_at": pa.array(np.full(size, now)),
        "bytes": pa.array(np.zeros(size, dtype=np.int64)),
        "prompt_ids": pa.ListArray.from_arrays(p_offsets, pa.array(rng.integers(0, 32000, size * prompt, np.int32))),
        "response_ids": pa.ListArray.from_arrays(offsets, pa.array(rng.integers(0, 32000, n_tok, np.int32))),
        "response_logprobs": pa.ListArray.from_arrays(offsets, pa.array(-rng.random(n_tok, dtype=np.float32))),
        "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(np.ones(n_tok, dtype=np.uint8))),
        "image_keys": pa.array([[]] * size, type=pa.list_(pa.binary(32))),
        "token_versions": pa.ListArray.from_arrays(offsets, pa.array(np.zeros(n_tok, dtype=np.int32))),
    }
    return pa.RecordBatch.from_pydict(cols, schema=TRAJECTORY_SCHEMA)


def start_store_process(memory_budget: int | None = None) -> NodeProcess:
    """A store node (port 0) in a subprocess (in the store host during a ``--hosts`` run)."""
    return start_node(ServerConfig(log_level="WARNING", store=StoreConfig(memory_budget=memory_budget or None)))


def fresh_copy(table: pa.Table, keep: list[pa.Buffer]) -> int:
    """Copy every buffer of ``table`` into newly allocated Arrow buffers (kept in ``keep``); returns bytes.

    The destination comes from the same Arrow memory pool the DoGet results come from, so both
    sides of the comparison allocate the same way.
    """
    copied = 0
    for col in table.columns:
        for chunk in col.chunks:
            for buf in chunk.buffers():
                if buf is None or buf.size == 0:
                    continue
                dst = pa.allocate_buffer(buf.size)
                np.frombuffer(dst, dtype=np.uint8)[:] = np.frombuffer(buf, dtype=np.uint8)
                copied += buf.size
                keep.append(dst)
    return copied


def bench_doget(
    client: StoreReader, node: str, total_bytes: int, tokens: int, passes: int, rng: np.random.Generator
) -> dict:
    """(a) DoGet micro-batches of 8 trajectories from the other process, vs an in-process copy.

    Two ways of fetching the same micro-batches, each pass:

    * **stream** (the headline: what the trainer does): the micro-batches read in order
      (``StoreReader.stream``); then every
      micro-batch's bytes are copied into new buffers (a separate timed phase, so the stream
      cannot run ahead during the copies);
    * **per call**: one ``StoreReader.fetch`` per micro-batch, each followed right away by the
      copy of its bytes, so both sides see the same load on a shared machine.

    Fetched tables and copies stay alive for the pass. Each side keeps its best pass; the copy's
    best is taken over both phases (the faster baseline). The first pass (cold: every page touched
    for the first time) is reported too.
    """
    mb_rows = 8
    row_bytes = tokens * BYTES_PER_TOKEN
    n_groups = max(1, -(-total_bytes // (row_bytes * mb_rows)))
    with StoreWriter.sharing(client) as writer:
        for g in range(n_groups):
            writer.put_group(make_group(f"big{g}", mb_rows, tokens, rng), node=node)
    plans = [[PlannedSlice(node=node, group_id=f"big{g}", start=0, stop=mb_rows)] for g in range(n_groups)]
    client.fetch(plans[0])  # warm the connection
    stream_s: list[float] = []
    per_call_s: list[float] = []
    copy_s: list[float] = []
    got = copied = 0
    for _ in range(passes):
        t_stream, t_copy, got, copied = _stream_pass(client, plans)
        stream_s.append(t_stream)
        copy_s.append(t_copy)
        t_get, t_copy = _per_call_pass(client, plans)
        per_call_s.append(t_get)
        copy_s.append(t_copy)
    best_copy = min(copy_s)
    return {
        "doget_gbps": got / min(stream_s) / 1e9,
        "doget_per_call_gbps": got / min(per_call_s) / 1e9,
        "copy_gbps": copied / best_copy / 1e9,
        "doget_first_pass_gbps": got / stream_s[0] / 1e9,
        "copy_first_pass_gbps": copied / copy_s[0] / 1e9,
        "doget_bytes": got,
        "copy_bytes": copied,
        "doget_s": min(stream_s),
        "doget_per_call_s": min(per_call_s),
        "copy_s": best_copy,
        "microbatches": n_groups,
    }


def _stream_pass(client: StoreReader, plans: list[list[PlannedSlice]]) -> tuple[float, float, int, int]:
    """One DoGet streaming every micro-batch, then a copy of all their bytes (a separate timed phase, so the
    stream cannot run ahead during the copies): ``(stream s, copy s, bytes fetched, bytes copied)``."""
    t0 = time.perf_counter()
    tables = list(client.stream(plans))
    stream_s = time.perf_counter() - t0
    keep: list[pa.Buffer] = []
    t0 = time.perf_counter()
    copied = sum(fresh_copy(table, keep) for table in tables)
    return stream_s, time.perf_counter() - t0, sum(table.nbytes for table in tables), copied


def _per_call_pass(client: StoreReader, plans: list[list[PlannedSlice]]) -> tuple[float, float]:
    """One DoGet per micro-batch, each followed right away by the copy of its bytes: ``(fetch s, copy s)``,
    summed over the micro-batches (fetched tables and copies stay alive for the pass)."""
    tables: list[pa.Table] = []
    keep: list[pa.Buffer] = []
    t_get = t_copy = 0.0
    for p in plans:
        t0 = time.perf_counter()
        table = client.fetch(p)
        t1 = time.perf_counter()
        fresh_copy(table, keep)
        t_get, t_copy = t_get + t1 - t0, t_copy + time.perf_counter() - t1
        tables.append(table)
    return t_get, t_copy


def bench_meta_scan(rows: int, repeats: int, rng: np.random.Generator) -> dict:
    """(b) full metadata scans over Flight with 1 KiB vs 256 KiB of payload per row.

    One node per payload size, both up at once; the scans alternate between them, so both sizes
    see the same machine load (median of ``repeats`` each). The nodes run in this process, or in the
    store host during a ``--hosts`` run.
    """
    sizes = {"small": 1024, "large": 256 * 1024}
    group_size = 8
    with contextlib.ExitStack() as stack:
        clients = {}
        for label, payload in sizes.items():
            server: NodeProcess | StoreServer
            if network_mode() == "hosts":
                server = stack.enter_context(start_store_process())
            else:
                server = stack.enter_context(StoreServer())
            client = clients[label] = stack.enter_context(StoreReader(server.location))
            tokens = max(1, (payload - 4 * 16) // BYTES_PER_TOKEN)
            with StoreWriter.sharing(client) as writer:
                for g in range(rows // group_size):
                    writer.put_group(make_group(f"{label}{g}", group_size, tokens, rng))
            client.scan_metadata()  # warm
        times: dict[str, list[float]] = {label: [] for label in sizes}
        for _ in range(repeats):
            for label, client in clients.items():
                with timer() as t:
                    frame = client.scan_metadata()
                times[label].append(t[0])
                if frame.height != rows:
                    msg = f"scan returned {frame.height} rows, expected {rows}"
                    raise RuntimeError(msg)
        out = {}
        for label, client in clients.items():
            out[f"meta_scan_ms_{label}"] = statistics.median(times[label]) * 1e3
            out[f"stored_bytes_{label}"] = next(iter(client.stats().values())).memory_used
    return out


def bench_latency(client: StoreReader, node: str, groups: int, fetches: int, rng: np.random.Generator) -> dict:
    """(c) p50/p99 of fetching 8 trajectories (8 random groups, one row each) from a store of ``groups`` groups."""
    size = 4
    with timer() as w, StoreWriter.sharing(client) as writer:
        for g in range(groups):
            writer.put_group(make_group(f"s{g}", size, 256, rng), node=node)
    lat = []
    for i in range(fetches + 20):
        picks = rng.choice(groups, size=8, replace=False)
        slices = [
            PlannedSlice(node=node, group_id=f"s{g}", start=int(r), stop=int(r) + 1)
            for g, r in zip(picks, rng.integers(0, size, 8), strict=True)
        ]
        t0 = time.perf_counter()
        table = client.fetch(slices)
        dt = time.perf_counter() - t0
        if table.num_rows != 8:
            msg = f"micro-batch fetch returned {table.num_rows} rows"
            raise RuntimeError(msg)
        if i >= 20:  # the first calls warm up
            lat.append(dt * 1e3)
    arr = np.asarray(lat)
    return {
        "microbatch_fetch_ms_p50": float(np.percentile(arr, 50)),
        "microbatch_fetch_ms_p99": float(np.percentile(arr, 99)),
        "microbatch_fetch_ms_mean": float(arr.mean()),
        "write_groups_per_s": groups / w[0],
        "latency_samples": lat,
    }


def plot(path: Path, metrics: dict, latencies: list[float]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.6))
    a.bar(
        ["DoGet stream", "DoGet per call", "memcpy (fresh)"],
        [metrics["doget_gbps"], metrics["doget_per_call_gbps"], metrics["copy_gbps"]],
        color=["tab:blue", "tab:cyan", "tab:gray"],
    )
    a.set_ylabel("GB/s")
    a.set_title("(a) micro-batch DoGet vs copy")
    b.bar(
        ["1 KiB/row", "256 KiB/row"],
        [metrics["meta_scan_ms_small"], metrics["meta_scan_ms_large"]],
        color=["tab:green", "tab:olive"],
    )
    b.set_ylabel("ms")
    b.set_title("(b) full metadata scan")
    c.hist(latencies, bins=40, color="tab:purple")
    c.axvline(metrics["microbatch_fetch_ms_p50"], color="k", ls="--", label="p50")
    c.axvline(metrics["microbatch_fetch_ms_p99"], color="r", ls="--", label="p99")
    c.set_xlabel("ms")
    c.set_title("(c) fetch of 8 trajectories")
    c.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


FRESH_MEMORY_ENV = {
    "ARROW_DEFAULT_MEMORY_POOL": "system",
    "MALLOC_MMAP_THRESHOLD_": "131072",
    "MALLOC_TRIM_THRESHOLD_": "67108864",
}
"""Part (a) runs in a child with these: every buffer over 128 KiB is a fresh mmap, on both sides.

Smaller allocations come from the malloc heap, on both sides, and are recycled as in any process.
The trim threshold says so explicitly: fixing ``M_MMAP_THRESHOLD`` also freezes glibc's trim
threshold at its 128 KiB default (mallopt(3): setting either disables their dynamic adjustment),
so every ``free`` that leaves more than 128 KiB free at the top of a heap hands it back to the
kernel (``madvise``/``sbrk``) and the next allocation faults it in again. That hit only the DoGet
side: gRPC receives into 64 KiB heap slices, ~2.4 MB of them per micro-batch, freed as soon as
the message is assembled, so each fetch re-faulted much of its receive buffer (measured: ~270
page faults and ~1.3 ``madvise`` calls more per micro-batch, ~15% of the client's CPU, ~0.5 ms;
on top of the first touch of the result, which stays: ~580 faults, as many as the copy's). With glibc's
defaults the trim threshold follows the largest freed mmap (twice it: ~4.8 MB once a 2.4 MB result
is freed, at most 64 MiB), so a trainer never re-faults these; 64 MiB is that ceiling. Buffers over
128 KiB -- the DoGet results and the copies -- are still fresh mmaps, unmapped when freed, whatever
the trim threshold.
"""


def run_doget(params: dict, seed: int) -> dict:
    """Part (a) against its own store process."""
    rng = np.random.default_rng(seed)
    node = start_store_process()
    try:
        with StoreReader(node.location, timeout=120) as client:
            return bench_doget(
                client,
                node.location,
                params["doget_total_mib"] * MIB,
                params["doget_response_tokens"],
                params["doget_passes"],
                rng,
            )
    finally:
        node.stop()


def run_doget_fresh(params: dict, seed: int, out: Path) -> dict:
    """Part (a) in a child process whose allocations all come fresh from the kernel."""
    env = {**os.environ, **FRESH_MEMORY_ENV, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bench.flight_throughput", "--part", "doget", "--seed", str(seed), "--out", str(out)]
    if params["quick"]:
        cmd.append("--quick")
    subprocess.run(cmd, env=env, check=True, timeout=600)
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.flight_throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="64 MiB DoGet, fewer repeats (about 30 s)")
    parser.add_argument("--out", required=True, help="result JSON path (a PNG is written beside it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hosts", action="store_true",
                        help="stores in one host, this benchmark in another (network namespaces; needs root)")
    parser.add_argument("--part", choices=["all", "doget"], default="all", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hosts:
        return run_in_hosts("bench.flight_throughput", sys.argv[1:] if argv is None else argv, Path(args.out))

    params = _params(args.quick)
    out = Path(args.out)
    if args.part == "doget":
        out.write_text(json.dumps(run_doget(params, args.seed)))
        return 0
    a, b, c, latencies = _measure(params, args.seed)
    metrics = {**a, **b, **c}
    ratios = {
        "doget_vs_copy": a["doget_gbps"] / a["copy_gbps"],
        "doget_per_call_vs_copy": a["doget_per_call_gbps"] / a["copy_gbps"],
        "doget_vs_copy_first_pass": a["doget_first_pass_gbps"] / a["copy_first_pass_gbps"],
        "doget_vs_copy_pool": a["doget_pool_gbps"] / a["copy_pool_gbps"],
        "meta_scan_large_vs_small": b["meta_scan_ms_large"] / b["meta_scan_ms_small"],
    }
    targets = {
        "doget_vs_copy": ">= 0.5",
        "meta_scan_large_vs_small": "<= 1.5",
        "microbatch_fetch_ms_p50": "<= 2",
    }
    passed = {
        "doget_vs_copy": ratios["doget_vs_copy"] >= 0.5,
        "meta_scan_large_vs_small": ratios["meta_scan_large_vs_small"] <= 1.5,
        "microbatch_fetch_ms_p50": metrics["microbatch_fetch_ms_p50"] <= 2.0,
    }
    write_result(out, metrics, ratios, params, targets=targets, passed=passed)
    plot(out.with_suffix(".png"), metrics, latencies)
    _print_summary(a, b, c, ratios, params)
    print(f"wrote {out}")
    return 0


def _params(quick: bool) -> dict:
    return {
        "quick": quick,
        "network": network_mode(),
        "doget_total_mib": 64 if quick else 256,
        "doget_response_tokens": 32768,
        "doget_passes": 3,
        "microbatch_rows": 8,
        "meta_rows": 1024 if quick else 2048,
        "meta_repeats": 30 if quick else 60,
        "latency_groups": 4096,
        "latency_fetches": 1000 if quick else 3000,
        "fresh_memory_env": FRESH_MEMORY_ENV,
    }


def _measure(params: dict, seed: int) -> tuple[dict, dict, dict, list[float]]:
    """(a) DoGet vs copy, in a fresh process and again in this one (pooled pages); (b) metadata scans;
    (c) micro-batch fetch latency. Returns their figures and (c)'s latency samples."""
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        a = run_doget_fresh(params, seed, Path(tmp) / "doget.json")
    pool = run_doget(params, seed)  # the same in this process: the Arrow pool recycles pages
    a.update({f"{k.replace('_gbps', '')}_pool_gbps": v for k, v in pool.items() if k.endswith("_gbps")})
    with start_store_process() as node, StoreReader(node.location, timeout=120) as client:
        c = bench_latency(client, node.location, params["latency_groups"], params["latency_fetches"], rng)
    b = bench_meta_scan(params["meta_rows"], params["meta_repeats"], rng)
    return a, b, c, c.pop("latency_samples")


def _print_summary(a: dict, b: dict, c: dict, ratios: dict, params: dict) -> None:
    print(
        f"(a) DoGet {a['doget_gbps']:.2f} GB/s (one call streaming the micro-batches; "
        f"{a['doget_per_call_gbps']:.2f} GB/s with one call per micro-batch) vs fresh-memory copy "
        f"{a['copy_gbps']:.2f} GB/s -> ratio {ratios['doget_vs_copy']:.2f} (target >= 0.5; per call "
        f"{ratios['doget_per_call_vs_copy']:.2f})"
    )
    print(
        f"(b) metadata scan {b['meta_scan_ms_small']:.2f} ms (1 KiB/row) vs {b['meta_scan_ms_large']:.2f} ms "
        f"(256 KiB/row) -> ratio {ratios['meta_scan_large_vs_small']:.2f} (target <= 1.5)"
    )
    print(
        f"(c) fetch of 8 trajectories from {params['latency_groups']} groups: "
        f"p50 {c['microbatch_fetch_ms_p50']:.2f} ms, p99 {c['microbatch_fetch_ms_p99']:.2f} ms (target p50 <= 2)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
