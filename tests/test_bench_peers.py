"""The peers benchmark's paths deliver the same work: every rank gets the same rows in the same micro-batches.

knittrans, TransferQueue (the package) and verl's DataProto through its worker group (the package)
each run one train step per plan of a tiny workload; each rank's micro-batches must hold the same
token ids and advantages on every path, and the driver must carry no payload on knittrans' path.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from bench.cluster.workload import Workload, make_group
from bench.peers.common import step_specs

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    import ray

    from bench.peers.harness import ray_env
    from bench.peers.knit import KnitPath
    from bench.store_groups import start_store_process

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
    """Same rows, tokens and advantages on every path; knittrans' ranks and TransferQueue's receive the same
    payload bytes (the two sides of ``data_movement_vs_transferqueue`` move the same work), verl's at least those."""
    from bench.peers.harness import _knit_driver_bytes
    from bench.peers.tq import TQPath
    from bench.peers.verl_dp import VerlPath

    w, specs, knit = cluster["w"], cluster["specs"], cluster["knit"]
    tq = TQPath(w)
    verls = {mode: VerlPath(w, mode, checksums=True) for mode in ("trainer", "numpy")}
    try:
        tq.load(cluster["groups"])
        for v in verls.values():
            v.load(cluster["groups"], specs)
        for s, per_rank in enumerate(specs):
            got = {"knittrans": knit.step(per_rank, 0.0, 1, checksums=True),
                   "transferqueue": tq.step(per_rank, 0.0, 1, checksums=True),
                   **{f"verl_{m}": v.step(s, per_rank, 0.0) for m, v in verls.items()}}
            for r in range(w.ranks):
                want = got["knittrans"][r]
                assert len(want["checksums"]) == len(per_rank[r]) >= 1 and all(tok > 0 for tok, _ in want["checksums"])
                for name in got:
                    assert got[name][r]["checksums"] == want["checksums"], (name, s, r)
                    assert got[name][r]["tokens"] == want["tokens"]
                    assert got[name][r]["bytes"] >= want["bytes"] > 0, name
                assert got["transferqueue"][r]["bytes"] == want["bytes"]
        assert len(tq.fetch_latencies(specs[0][0])) == len(specs[0][0])  # reads every micro-batch by key
        _check_keys(w, specs, knit, tq, verls)
    finally:
        for v in verls.values():
            v.close()
        tq.close()
    assert _knit_driver_bytes(knit, specs) == 0


def _check_keys(w: Workload, specs: list[Any], knit: Any, tq: Any, verls: dict[str, Any]) -> None:
    """The result file's keys at a tiny size: data movement against every peer and the best verl path, the
    calibrated cell's step ratios and compute."""
    from bench.peers.harness import _calibrated, summarize
    from bench.peers.turns import steps_in_turn

    steppers = {"knittrans": lambda s, per_rank, c: knit.step(per_rank, c, 1),
                "transferqueue": lambda s, per_rank, c: tq.step(per_rank, c, 1),
                **{v.name: v.step for v in verls.values()}}
    steps = steps_in_turn(steppers, specs, [0.0])
    cal_w = Workload(steps=1, groups=2, group_size=4, mini_batches=1, ranks=2, prompt_len=8, response_mean=16,
                     response_max=32, token_budget=1024, seed=5)
    raw = {"specs": {}, "groups_bytes": 1, "driver_payload_bytes_knittrans": 0, "steps": steps, "put": {},
           "groups": 1, "fetch": {"knittrans": [1.0], "minimal_flight": [1.0], "minimal_flight_exchange": [1.0]},
           "calibrated": _calibrated(knit, tq, {f"verl_{m}": v for m, v in verls.items()}, steps, (cal_w, 2.0), 0.0)}
    metrics, ratios = summarize(raw, w, [0.0])
    for key in ("data_movement_vs_transferqueue", "data_movement_vs_verl_trainer", "data_movement_vs_verl_numpy",
                "data_movement_vs_verl_best", "step_vs_verl_best_calibrated", "step_vs_transferqueue_calibrated"):
        assert ratios[key] > 0, key
    assert not [k for k in ratios if k.startswith("step_vs_") and not k.endswith("_calibrated")]
    assert ratios["data_movement_vs_verl_best"] == min(ratios["data_movement_vs_verl_trainer"],
                                                       ratios["data_movement_vs_verl_numpy"])
    assert metrics["calibrated_compute_ms_per_ktok"] == 2.0
    assert metrics["calibrated_verl_best"] in ("verl_trainer", "verl_dataproto_numpy")
    assert metrics["rank_bytes_per_step_transferqueue"] == metrics["rank_bytes_per_step_knittrans"] > 0


def test_replicated_image_groups_store_every_rows_copy_and_the_others_one() -> None:
    from bench.peers.mm import mm_groups

    w = Workload(steps=1, groups=2, group_size=4, mini_batches=1, ranks=2, prompt_len=8, response_mean=16,
                 response_max=32, multimodal=True, image_shape=(3, 8, 8))
    once = mm_groups(w, np.random.default_rng(2), "a", replicated=False)
    rep = mm_groups(w, np.random.default_rng(2), "b", replicated=True)
    for (g1, t1), (g2, t2) in zip(zip(once[0], once[1], strict=True), zip(rep[0], rep[1], strict=True), strict=True):
        keys1, keys2 = g1.column("image_keys").to_pylist(), g2.column("image_keys").to_pylist()
        assert len({k for ks in keys1 for k in ks}) == 1 and t1.num_rows == 1
        assert len({k for ks in keys2 for k in ks}) == w.group_size == t2.num_rows
        assert g1.column("response_ids").equals(g2.column("response_ids"))  # the same tokens otherwise
    assert len(rep[2]) == w.group_size * len(once[2])


def test_transferqueue_tensordicts_pack_as_the_trainer_packs_arrow() -> None:
    """``pack_tensordict`` on a group as TransferQueue holds it gives ``train.packing.pack``'s tensors exactly."""
    import torch

    from bench.peers.tq import group_fields, pack_tensordict
    from train.packing import PACK_COLUMNS, pack_tensors

    w = Workload(steps=1, groups=4, group_size=5, mini_batches=2, ranks=2, prompt_len=7, response_mean=20,
                 response_max=64, token_budget=1024)
    group = make_group("g0", w, np.random.default_rng(11))
    _, td, _, _ = group_fields(group)
    adv = [0.5, -1.0, 2.0, 0.0, 1.5]
    want = pack_tensors(group.select(list(PACK_COLUMNS)), adv, mode="padded").to_torch()
    got = pack_tensordict(td, adv)
    assert set(got) == set(want)
    for name, t in want.items():
        assert (t is None and got[name] is None) or torch.equal(got[name], t), name


def test_step_specs_cover_every_planned_row_once(cluster: dict[str, Any]) -> None:
    w, specs = cluster["w"], cluster["specs"]
    rows = [tuple(row) for step in specs for rank in step for m in rank for row in m["rows"]]
    assert len(rows) == len(set(rows)) == len(cluster["groups"]) * w.group_size


@pytest.mark.parametrize("own_pages", [False, True], ids=["kept", "own_pages"])
def test_the_minimal_servers_reads_by_doget_and_over_one_exchange_give_the_same_rows(own_pages: bool) -> None:
    import pyarrow.flight as flight

    from bench import minimal_flight

    w = Workload(steps=1, groups=4, group_size=4, mini_batches=2, ranks=2, prompt_len=8, response_mean=16,
                 response_max=32, token_budget=1024)
    rng = np.random.default_rng(3)
    groups = {f"g{i}": make_group(f"g{i}", w, rng) for i in range(2)}
    proc, location = minimal_flight.start(own_pages=own_pages)
    assert ("--own-pages" in str(proc.args)) == own_pages  # the mode reaches the server's process
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
            assert by_exchange.equals(pa.Table.from_batches([groups[key].slice(a, b - a) for key, a, b in ranges]))
        channel[0].done_writing()
        channel[0].close()
    finally:
        client.close()
        proc.kill()
        proc.wait(timeout=10)


def test_the_minimal_server_with_own_pages_keeps_a_copy_not_the_received_message() -> None:
    import threading

    import pyarrow.flight as flight

    from bench import minimal_flight
    from flight_store.blocks import view

    w = Workload(steps=1, groups=2, group_size=4, mini_batches=1, ranks=1, prompt_len=8, response_mean=4096,
                 response_max=8192, token_budget=1 << 16)
    group = make_group("g0", w, np.random.default_rng(5))  # over 16 KiB: a block in pages of its own
    server = minimal_flight.MinimalFlight("grpc://127.0.0.1:0", own_pages=True)
    threading.Thread(target=server.serve, daemon=True).start()
    client = flight.connect(f"grpc://127.0.0.1:{server.port}")
    try:
        minimal_flight.put(client, "g0", group)
        schema, blocks = server.kept[b"g0"]  # blocks, not the received batches
        assert len(blocks) == 1 and isinstance(blocks[0], mmap.mmap)
        assert view(blocks[0], schema).equals(group)
    finally:
        client.close()
        server.shutdown()
