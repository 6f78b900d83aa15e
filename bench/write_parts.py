"""Where a write's gap to a minimal Flight DoPut sits: store nodes with one part of their write made free.

``python -m bench.write_parts [--quick] --out F.json``

A diagnostic of ``bench.write_path``'s ``put_vs_minimal_flight`` (no target). Each node runs in a process of its
own (``knit serve``'s defaults: no budget, no spill log) with one part of ``Store``'s write replaced in that process
only (:data:`VARIANTS`):

* ``as_is``: nothing replaced;
* ``no_store``: ``Store.put_group`` stores nothing (what is left: the DoPut's protocol and the node's framing);
* ``copy_only``: each received batch copied into pages of its own (:func:`flight_store.blocks.pack`, as the node
  does) and kept, nothing checked or indexed;
* ``check_free``: the batch passed on unchecked (no rule check, no ``bytes`` column), committed as usual;
* ``commit_free``: checked and copied as usual, the blocks kept in a dict (no group table, metadata log or memory
  account).

Beside them the minimal Flight server of :mod:`bench.minimal_flight`, as it is and copying into pages of its own.
Every server takes its turn on the same groups (8 x ``--tokens``, all 19 columns, one DoPut each), the order
rotating with the repetition; ``ratios.parts_<server>_vs_minimal`` is the minimal server's median time per group
over that server's (the same groups, bytes and DoPuts on both sides), ``metrics.parts_ms_per_group_<server>`` the
medians. The nodes other than ``as_is`` are not stores (their groups cannot be read back): they only bound what
each part costs.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from bench import minimal_flight
from bench._common import write_result
from bench.store_groups import make_group
from bench.write_path import interleaved
from flight_store.blocks import Block, pack
from flight_store.config import ServerConfig
from flight_store.node import NodeProcess
from flight_store.store import StoreConfig
from flight_store.writing import StoreWriter

VARIANTS = ("as_is", "no_store", "copy_only", "check_free", "commit_free")
"""The nodes, each with one part of its write made free (see the module's docstring)."""
MINIMAL = ("minimal", "minimal_own_pages")
"""The minimal Flight server as it is, and copying each received batch into pages of its own."""
_kept: dict[str, list[Block]] = {}  # copy_only's and commit_free's blocks, in the node's process


def _rows(batches: Sequence[pa.RecordBatch]) -> int:
    return sum(b.num_rows for b in batches)


def _store_nothing(self: Any, group_id: str, batches: Sequence[pa.RecordBatch], rows: int | None = None,
                   meta: dict[str, str] | None = None, *, incoming: Any = None) -> int:
    return _rows(batches)


def _copy_only(self: Any, group_id: str, batches: Sequence[pa.RecordBatch], rows: int | None = None,
               meta: dict[str, str] | None = None, *, incoming: Any = None) -> int:
    _kept[group_id] = [pack(b)[0] for b in batches]
    return _rows(batches)


def _unchecked(batches: Sequence[pa.RecordBatch], group_id: str, rows: int) -> tuple[list[pa.RecordBatch], list[None]]:
    return list(batches), [None] * len(batches)


def _commit_nothing(self: Any, group_id: str, normalized: Sequence[pa.RecordBatch], meta: dict[str, str] | None,
                    incoming: Any, sizes: Sequence[Any] = ()) -> int:
    _kept[group_id] = [pack(b)[0] for b in normalized]
    return _rows(normalized)


def _replace(variant: str) -> None:
    """Replace ``variant``'s part of the store's write in this process."""
    from flight_store import store

    parts: dict[str, tuple[Any, str, Callable[..., Any]]] = {
        "no_store": (store.Store, "put_group", _store_nothing),
        "copy_only": (store.Store, "put_group", _copy_only),
        "check_free": (store, "normalize_group_sized", _unchecked),
        "commit_free": (store.Store, "_commit_group", _commit_nothing),
    }
    if variant in parts:
        owner, name, fn = parts[variant]
        setattr(owner, name, fn)


def start(variant: str) -> NodeProcess:
    """A node with ``variant``'s part replaced, in a process of its own on loopback."""
    if variant not in VARIANTS:
        msg = f"unknown variant {variant!r}; variants: {list(VARIANTS)}"
        raise ValueError(msg)
    # the prefix runs this module, which replaces the part and then serves the config the node command names
    return NodeProcess(ServerConfig(log_level="WARNING", store=StoreConfig()),
                       prefix=[sys.executable, "-m", "bench.write_parts", "--serve", variant, "--"])


def _serve(variant: str, command: list[str]) -> int:
    """``python -m bench.write_parts --serve VARIANT -- <the node's command>``: the node, its part replaced."""
    from flight_store.__main__ import main as serve_node

    _replace(variant)
    return serve_node(command[command.index("--config"):])


def _put_minimal(client: flight.FlightClient, group: pa.RecordBatch) -> None:
    minimal_flight.put(client, str(group.column("group_id")[0]), group)


def run(groups_n: int, size: int, tokens: int, reps: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    payload = make_group("g", size, tokens, rng).nbytes
    nodes: dict[str, NodeProcess] = {}
    sinks: dict[str, tuple[Any, str]] = {}
    times: dict[str, list[float]] = {name: [] for name in (*VARIANTS, *MINIMAL)}
    try:
        for v in VARIANTS:
            nodes[v] = start(v)
        sinks = {"minimal": minimal_flight.start(), "minimal_own_pages": minimal_flight.start(own_pages=True)}
        writers = {v: StoreWriter(node.location) for v, node in nodes.items()}
        raws = {name: flight.connect(location) for name, (_, location) in sinks.items()}
        writes: dict[str, Callable[[pa.RecordBatch], object]] = {v: w.put_group for v, w in writers.items()}
        for name, c in raws.items():
            writes[name] = functools.partial(_put_minimal, c)
        for rep in range(reps):
            interleaved(writes, [make_group(f"r{rep}g{i}", size, tokens, rng) for i in range(groups_n)], rep, times)
        for w in writers.values():
            w.close()
        for c in raws.values():
            c.close()
    finally:
        for node in nodes.values():
            node.stop()
        for proc, _ in sinks.values():
            proc.kill()
            proc.wait(timeout=10)
    ms = {name: statistics.median(ts) / groups_n * 1e3 for name, ts in times.items()}
    return {"metrics": {"group_bytes": payload, **{f"parts_ms_per_group_{name}": v for name, v in ms.items()}},
            "ratios": {f"parts_{name}_vs_minimal": ms["minimal"] / ms[name] for name in ms if name != "minimal"}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return _serve(argv[1], argv[argv.index("--") + 1:])
    parser = argparse.ArgumentParser(prog="python -m bench.write_parts", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer groups and repetitions")
    parser.add_argument("--out", default="results/write_parts.json")
    parser.add_argument("--groups", type=int, default=None, help="groups per repetition (300; quick 150)")
    parser.add_argument("--size", type=int, default=8, help="trajectories per group (G)")
    parser.add_argument("--tokens", type=int, default=2048, help="response tokens per trajectory")
    parser.add_argument("--reps", type=int, default=None, help="repetitions, medians reported (6; quick 4)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    groups_n = args.groups or (150 if args.quick else 300)
    reps = args.reps or (4 if args.quick else 6)
    result = run(groups_n, args.size, args.tokens, reps, args.seed)
    params = {"quick": args.quick, "groups": groups_n, "size": args.size, "tokens": args.tokens, "reps": reps,
              "seed": args.seed, "transport": "loopback, one DoPut per group, servers in processes of their own"}
    write_result(args.out, result["metrics"], result["ratios"], params)
    m = result["metrics"]
    for name in (*VARIANTS, *MINIMAL):
        ratio = result["ratios"].get(f"parts_{name}_vs_minimal", 1.0)
        print(f"{name:18s} {m[f'parts_ms_per_group_{name}']:.3f} ms/group  {ratio:.2f} of the minimal server's speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
