"""The peers benchmark's paths deliver the same work: every rank gets the same rows in the same micro-batches.

knittrans, TransferQueue (the package) and verl's DataProto through its worker group (the package)
each run one train step per plan of a tiny workload; each rank's micro-batches must hold the same
token ids and advantages on every path, and the driver must carry no payload on knittrans' path.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from bench.cluster.workload import Workload, make_group
from bench.peers.common import step_specs

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    import ray

    from bench.flight_throughput import start_store_process
    from bench.peers.harness import ray_env
    from bench.peers.knit import KnitPath

    w = Workload(steps=1, groups=4, group_size=4, mini_batches=2, ranks=2, prompt_len=32, response_mean=64,
                 response_max=256, token_budget=1024)
    rng = np.random.default_rng(7)
    groups = [make_group(f"s{s}-g{g}", w, rng) for s in range(2) for g in range(w.groups)]
    with contextlib.ExitStack() as stack:  # stopped last first: Ray, then its environment, then the nodes
        nodes = [stack.enter_context(start_store_process()) for _ in range(2)]
        stack.enter_context(ray_env())
        ray.init(num_cpus=16, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level=logging.WARNING)
        stack.callback(ray.shutdown)
        knit = KnitPath(w, [n.location for n in nodes])
        stack.callback(knit.close)
        knit.load(groups)
        from bench.peers.harness import _plans

        yield {"w": w, "groups": groups, "knit": knit, "specs": step_specs(_plans(knit, w, 2), w.mini_batches, w.ranks)}


def test_every_path_gives_each_rank_the_same_micro_batches(cluster: dict[str, Any]) -> None:
    from bench.peers.harness import _knit_driver_bytes
    from bench.peers.tq import TQPath
    from bench.peers.verl_dp import VerlPath

    w, specs, knit = cluster["w"], cluster["specs"], cluster["knit"]
    tq = TQPath(w)
    verl = VerlPath(w, "numpy", checksums=True)
    try:
        tq.load(cluster["groups"])
        verl.load(cluster["groups"], specs)
        for s, per_rank in enumerate(specs):
            got = {"knittrans": knit.step(per_rank, 0.0, 1, checksums=True),
                   "transferqueue": tq.step(per_rank, 0.0, 1, checksums=True),
                   "verl": verl.step(s, per_rank, 0.0)}
            for r in range(w.ranks):
                want = got["knittrans"][r]["checksums"]
                assert len(want) == len(per_rank[r]) >= 1 and all(tok > 0 for tok, _ in want)
                for name in ("transferqueue", "verl"):
                    assert got[name][r]["checksums"] == want, (name, s, r)
                    assert got[name][r]["tokens"] == got["knittrans"][r]["tokens"]
        assert len(tq.fetch_latencies(specs[0][0])) == len(specs[0][0])  # reads every micro-batch by key
    finally:
        verl.close()
        tq.close()
    assert _knit_driver_bytes(knit, specs) == 0


def test_step_specs_cover_every_planned_row_once(cluster: dict[str, Any]) -> None:
    w, specs = cluster["w"], cluster["specs"]
    rows = [tuple(row) for step in specs for rank in step for m in rank for row in m["rows"]]
    assert len(rows) == len(set(rows)) == len(cluster["groups"]) * w.group_size


def test_the_minimal_servers_reads_by_doget_and_over_one_exchange_give_the_same_rows() -> None:
    import pyarrow.flight as flight

    from bench import minimal_flight

    w = Workload(steps=1, groups=4, group_size=4, mini_batches=2, ranks=2, prompt_len=8, response_mean=16,
                 response_max=32, token_budget=1024)
    rng = np.random.default_rng(3)
    groups = {f"g{i}": make_group(f"g{i}", w, rng) for i in range(2)}
    proc, location = minimal_flight.start()
    client = flight.connect(location)
    try:
        for key, group in groups.items():
            minimal_flight.put(client, key, group)
        channel = minimal_flight.open_channel(client)
        for ranges in ([("g1", 1, 3), ("g0", 0, 1)], [("g0", 2, 4)]):  # one request after another on the channel
            minimal_flight.send(channel, ranges)
            by_exchange = minimal_flight.receive(channel)
            assert by_exchange.equals(minimal_flight.get(client, ranges))
            assert by_exchange.num_rows == sum(b - a for _, a, b in ranges)
        channel[0].done_writing()
        channel[0].close()
    finally:
        client.close()
        proc.kill()
        proc.wait(timeout=10)
