"""What both transfer benchmarks stand on: two store processes, Ray, the rank actors, the planner.

:func:`cluster` starts two store nodes as separate processes (``python -m flight_store --config``)
and a local Ray, and stops both afterwards; :func:`start_ranks` starts one
:class:`~bench.transfer.ranks.RankWorker` per trainer rank; :func:`admit` runs the admission
planner over the stores' metadata, as the on-demand driver does, and :func:`steps_as_json` hands
its mini-batch plans to the ranks, one list per train step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

from bench.transfer.driver import CountingClient
from bench.transfer.ranks import RankWorker
from bench.transfer.workload import Workload
from schemas.plan import MiniBatchPlan


@contextmanager
def cluster() -> Iterator[list[str]]:
    """Two store nodes (separate processes) and a local Ray; yields the stores' locations."""
    import ray

    from bench.flight_throughput import start_store_process

    nodes = [start_store_process() for _ in range(2)]
    stores = [n.location for n in nodes]
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level=logging.WARNING)
    try:
        yield stores
    finally:
        ray.shutdown()
        for n in nodes:
            n.stop()


def start_ranks(stores: list[str], w: Workload) -> list[Any]:
    """One :class:`RankWorker` Ray actor per trainer rank, ready (torch imported outside the clock)."""
    import ray

    actor = ray.remote(num_cpus=1)(RankWorker)
    ranks: list[Any] = [actor.remote(r, stores, asdict(w)) for r in range(w.ranks)]  # type: ignore[attr-defined]
    ray.get([r.ready.remote() for r in ranks])
    return ranks


def admit(driver: CountingClient, w: Workload, train_steps: int) -> list[MiniBatchPlan]:
    """The ``train_batch`` planner over the stores' metadata; exactly ``train_steps`` train batches' mini-batches."""
    from admission import AdmissionConfig, Planner

    planner = Planner(AdmissionConfig(train_batch_groups=w.groups, group_size=w.group_size,
                                      mini_batches=w.mini_batches, dp_ranks=w.ranks, token_budget=w.token_budget,
                                      policy="train_batch"))
    plans = planner.update(driver.scan_new(), current_version=0)
    if len(plans) != train_steps * w.mini_batches:
        msg = f"planner admitted {len(plans)} mini-batches, expected {train_steps * w.mini_batches}"
        raise RuntimeError(msg)
    return plans


def steps_as_json(plans: list[MiniBatchPlan], w: Workload, train_steps: int) -> list[list[str]]:
    """The plans as JSON, one list of ``mini_batches`` plans per train step (what a rank is sent)."""
    return [[p.model_dump_json() for p in plans[s * w.mini_batches:(s + 1) * w.mini_batches]]
            for s in range(train_steps)]
