"""Store nodes lost mid-run on hosts (network namespaces), one run: a node SIGKILLed, then a link cut off for longer
than the clients' call timeout.

Two store nodes run as real processes, each on a host of its own (``launcher.stores.Stores`` with the hosts'
sites and ``health`` probes, as ``knit run`` on hosts starts them). The real ``RolloutWorker`` (the scripted
engine, ``connectors.fake_engine``) writes prompt groups from a thread; this test's main thread plays the
trainer's part with the real ``admission.Planner`` over a ``StoreReader`` (scan, plan, fetch the rows, release),
and the driver's (``Stores.check`` every 0.1 s). Midway store node0's process is SIGKILLed (by the pid
``children.json`` records); later node1's host link is cut for three call timeouts. Each time the launcher leaves
the node out of routing (the cluster's version goes up), the writer routes its groups to the other node and the
reader stops asking it; node0 is started again from its spill log, node1 answers again once its link is back.
The run ends with every prompt trained exactly once (``ledger_check``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from admission import AdmissionConfig, Planner
from connectors.config import RolloutConfig
from connectors.fake_engine import FakeEngine
from connectors.rollout import RolloutWorker
from flight_store.reading import StoreReader
from flight_store.writing import StoreWriter
from launcher.children import Children
from launcher.placement import Placement, Site
from launcher.run_config import RunConfig, store_configs
from launcher.stores import Stores

pytestmark = [pytest.mark.hosts]

G, B, GROUPS = 4, 4, 48
CALL_TIMEOUT_S, CUT_S = 5.0, 15.0


def _kill(out: Path, name: str) -> None:
    pid = next(int(c["pid"]) for c in json.loads((out / "logs" / "children.json").read_text()) if c["name"] == name)
    os.kill(pid, signal.SIGKILL)


class _Trainer:
    """The trainer's part: scan new rows, plan with the real planner, fetch each plan's rows, release its groups."""

    def __init__(self, reader: StoreReader) -> None:
        self.reader = reader
        self.planner = Planner(AdmissionConfig(train_batch_groups=B, group_size=G, mini_batches=2, dp_ranks=2,
                                               policy="streaming"))
        self.rows: list[tuple[str, int]] = []
        self.frame: pl.DataFrame | None = None

    @property
    def groups(self) -> int:
        return len(self.rows) // G

    def step(self) -> None:
        new = self.reader.scan_new(partial=True)  # kept until planned, as train.planning.PlanSource keeps them
        self.frame = new if self.frame is None else pl.concat([self.frame, new], how="vertical_relaxed")
        for plan in self.planner.update(self.frame):
            slices = [s for r in plan.ranks for mb in r.micro_batches for s in mb.slices]
            table = self.reader.fetch(slices, columns=["group_id", "sample_idx"])
            self.rows += zip(table.column("group_id").to_pylist(), table.column("sample_idx").to_pylist(), strict=True)
            self.reader.release(plan.group_ids, partial=True)


def _run_rollout(worker: RolloutWorker, result: dict[str, Any]) -> None:
    """The rollout's thread: its report, or the traceback of what stopped it (the test's message names it)."""
    try:
        result["report"] = worker.run()
    except Exception:
        result["error"] = traceback.format_exc()


def _drive(stores: Stores, hosts: Any, trainer: _Trainer, events: dict[str, float], done: threading.Event,
           out: Path) -> None:
    """The driver's part (its own process in ``knit run``, a thread here): ``Stores.check`` every 0.1 s, which
    starts a dead node again and tells the nodes who is down; and the two losses, at a quarter and half the run."""
    try:
        while not done.wait(0.1):
            down = stores.check()
            if trainer.groups >= GROUPS // 4 and "killed" not in events:
                _kill(out, "store0")
                events["killed"] = time.time()
            if trainer.groups >= GROUPS // 2 and "cut" not in events and not down:
                hosts[1].cut()
                events["cut"] = time.time()
            if "cut" in events and "restored" not in events and time.time() - events["cut"] > CUT_S:
                hosts[1].restore()
                events["restored"] = time.time()
    except Exception:  # the test names it
        events["error"] = time.time()
        raise
    finally:
        if "cut" in events and "restored" not in events:  # the run ended within the cut
            hosts[1].restore()
            events["restored"] = time.time()


def test_a_killed_node_and_a_long_cut_are_survived_and_every_prompt_trained_once(make_hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from ledger_check import each_prompt_trained_once

    hosts = make_hosts(2)
    placement = Placement(stores=[h.site() for h in hosts], rollout=Site(), trainer=[Site()], probe_s=0.2)
    configs = store_configs(RunConfig(num_stores=2, metrics=False, out=tmp_path), placement)
    events: dict[str, float] = {}
    with Children(tmp_path / "logs") as kids:
        stores = Stores(kids, configs, tmp_path, max_restarts=1, start_timeout_s=60, sites=placement.stores,
                        probe_s=0.2)
        stores.start()
        locs = stores.locations
        cfg = RolloutConfig(model="unused", stores=locs, group_size=G, max_groups=GROUPS, prompts_per_wave=4,
                            max_unreleased_groups=2 * B, lookahead_poll_s=0.0, version_poll_s=0.0,
                            group_id_prefix="t-", report_path=str(tmp_path / "rollout.json"))
        result: dict[str, Any] = {}
        try:
            with StoreWriter(locs, timeout=CALL_TIMEOUT_S, retries=20, backoff=0.05) as writer, \
                    StoreReader(locs, timeout=CALL_TIMEOUT_S, retries=20, backoff=0.05) as reader:
                worker = RolloutWorker(cfg, client=writer, engine=FakeEngine(max_steps=3))
                thread = threading.Thread(target=_run_rollout, args=(worker, result), daemon=True)
                thread.start()
                trainer = _Trainer(reader)
                done = threading.Event()
                driver = threading.Thread(target=_drive, args=(stores, hosts, trainer, events, done, tmp_path))
                driver.start()
                try:
                    deadline = time.monotonic() + 150
                    # until every group is trained and the link is back: the cut lasts CUT_S even if the groups
                    # left reach the trainer through node0 sooner
                    while ((trainer.groups < GROUPS or "restored" not in events) and time.monotonic() < deadline
                           and "error" not in events and "error" not in result):
                        trainer.step()
                        time.sleep(0.05)
                finally:
                    done.set()
                    driver.join(timeout=60)
                thread.join(timeout=30)
                stores.wait_up()
            # what the stores hold, read as the launcher reads it at the end: a new client, whose view is asked now
            # (the trainer's may be up to VIEW_TTL_S older than node1's return and leave it out)
            with StoreReader(locs, timeout=CALL_TIMEOUT_S, retries=20, backoff=0.05) as final:
                final.scan_metadata().write_parquet(tmp_path / "metadata.parquet")
        finally:
            stores.close()
    assert trainer.groups == GROUPS and "report" in result, (trainer.groups, events, result)
    (tmp_path / "rollout.json").write_text(json.dumps(result["report"].to_dict()))
    pl.DataFrame(trainer.rows, schema={"group_id": pl.String, "sample_idx": pl.Int64},
                 orient="row").write_parquet(tmp_path / "consumed.parquet")
    ledger = each_prompt_trained_once(tmp_path, group_size=G)
    assert ledger["prompts"] == GROUPS

    exited, cut = stores.outages
    assert exited.node == "node0" and exited.cause == "exited" and exited.back_at is not None
    assert cut.node == "node1" and cut.cause == "unreachable" and cut.back_at is not None
    assert cut.back_at - cut.died_at > CALL_TIMEOUT_S  # longer than a call may take
    views = stores.views.changes if stores.views else []
    assert [(v.version, v.down) for v in views] == [(2, ("node0",)), (3, ()), (4, ("node1",)), (5, ())]
    moved = [v.at - o.died_at for v, o in ((views[0], exited), (views[2], cut))]
    print(f"\nnode0 killed: found +{exited.died_at - events['killed']:.2f} s, routed around +{moved[0]:.2f} s, "
          f"back +{exited.back_at - events['killed']:.2f} s; node1 cut {events['restored'] - events['cut']:.1f} s: "
          f"found +{cut.died_at - events['cut']:.2f} s, routed around +{moved[1]:.2f} s after, back "
          f"+{cut.back_at - events['restored']:.2f} s after the restore; {ledger}")
