"""No process outlives its launcher (``launcher.lifeline``), and a new launcher copes with an older one's leftovers.

1. A launcher (a subprocess driving ``Children`` and ``Stores`` as ``knit run`` does) starts a store node on
   loopback, one inside a namespace host (``ip netns exec``), and a worker that has a child of its own; it is
   SIGKILLed alone: within 10 s no process it started is left (by the pids and start times it recorded, its
   keeper included), the stores' ports are free and nothing runs inside the host.
2. Leftovers of an older launcher (no parent-death signal, an index without start times): a store node
   still running from the run folder's config is refused by name while nothing records it, and stopped by
   its pid once the old index does; a launcher that still runs keeps its run folder.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flight_store.config import ServerConfig
from launcher import lifeline
from launcher.children import ROOT, Children, child_env
from launcher.hosts import Host
from schemas import documents

DRIVER = """
import json, sys, time
from pathlib import Path
from launcher.children import Children
from launcher.placement import Placement, Site
from launcher.run_config import RunConfig, store_configs
from launcher.stores import Stores

a = json.loads(sys.argv[1])
out = Path(a["out"])
sites = [Site()] + [Site(**s) for s in a["hosts"]]
cfg = RunConfig(num_stores=len(sites), out=out, metrics=False)
kids = Children(out / "logs")
stores = Stores(kids, store_configs(cfg, Placement(stores=sites, rollout=sites[0], trainer=[sites[0]])), out,
                max_restarts=0, start_timeout_s=60, sites=sites)
stores.start()
kids.start("worker", [sys.executable, "-c", a["worker"]])
print("READY", flush=True)
time.sleep(600)
"""
WORKER = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
          "print(p.pid, flush=True); time.sleep(600)")
"""A child with a child of its own (in its process group, with no parent-death signal): only the keeper ends it."""


def _running(pids: dict[str, tuple[int, int | None]]) -> list[str]:
    """The names of ``pids`` (name -> pid, start time) whose process still runs (zombies do not)."""
    return [n for n, (pid, started) in pids.items()
            if (now := lifeline.start_time(pid)) is not None and started in (None, now)]


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _wait_ready(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if "READY" in log.read_text():
            return
        time.sleep(0.1)
    pytest.fail(f"the launcher did not start its children (exit {proc.poll()}): {log.read_text()[-3000:]}")


def _launch(out: Path, hosts: list[Host], log: Path) -> subprocess.Popen[bytes]:
    sites = [{"address": h.address, "exec_prefix": h.exec_prefix, "env": {}, "name": f"host{h.index}"} for h in hosts]
    args = json.dumps({"out": str(out), "hosts": sites, "worker": WORKER})
    with log.open("wb") as f:
        return subprocess.Popen([sys.executable, "-c", DRIVER, args], cwd=ROOT, env=child_env(), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.hosts
def test_a_killed_launcher_leaves_no_process_locally_or_on_a_host(make_hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    host = make_hosts(1)[0]
    out = tmp_path / "run"
    out.mkdir()
    launcher = _launch(out, [host], tmp_path / "launcher.log")
    try:
        _wait_ready(launcher, tmp_path / "launcher.log", 90)
        started_at = time.monotonic()
        kids = json.loads((out / "logs" / "children.json").read_text())
        pids = {c["name"]: (c["pid"], c["start_time"]) for c in kids}
        worker_log = out / "logs" / "worker.log"
        while not worker_log.read_text().strip() and time.monotonic() < 60 + started_at:
            time.sleep(0.1)
        grandchild = int(worker_log.read_text().split()[0])
        keeper = json.loads((out / "logs" / "launcher.json").read_text())["keeper"]
        pids |= {"worker's child": (grandchild, lifeline.start_time(grandchild)), "keeper": (keeper, None)}
        assert sorted(pids) == ["keeper", "store0", "store1", "worker", "worker's child"]
        assert host.pids() == [pids["store1"][0]]  # the node inside the host is the child itself (ip execs)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10.0
        while _running(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(pids), f"still running 10 s after the launcher was killed: {_running(pids)}"
        assert host.pids() == []
        node = documents.read(ServerConfig, out / "configs" / "store0.json")
        assert _port_free(node.host, node.port)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def test_leftovers_of_an_older_launcher_are_refused_unrecorded_and_stopped_by_pid(tmp_path: Path) -> None:
    out = tmp_path / "run"
    node = ServerConfig(port=0, node_name="node0", log_level="WARNING")
    doc = documents.write(node, out / "configs" / "store0.json")
    cmd = [sys.executable, "-m", "flight_store", "--config", str(doc)]
    # what a launcher without a lifeline left: a node in a session of its own, no parent-death signal
    log = tmp_path / "store0.log"
    with log.open("wb") as f:
        old = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=f, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "listening on" not in log.read_text() and old.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "listening on" in log.read_text(), log.read_text()
        with pytest.raises(lifeline.LeftoverProcessesError, match=f"unrecorded \\(pid {old.pid}: .*store0.json"):
            Children(out / "logs")  # nothing records it: named, not signalled
        assert old.poll() is None
        (out / "logs").mkdir()
        (out / "logs" / "children.json").write_text(json.dumps([{"name": "store0", "pid": old.pid, "cmd": cmd,
                                                                 "restarts": 0}]))  # an older index's fields
        kids = Children(out / "logs")
        assert [(x.name, x.pid) for x in kids.leftovers] == [("store0", old.pid)]
        assert old.wait(timeout=1) == 0  # SIGTERM: a clean stop
    finally:
        if old.poll() is None:
            old.kill()
            old.wait()
    parent = os.getppid()  # a launcher that still runs: its run folder is refused
    (out / "logs" / "launcher.json").write_text(json.dumps({"pid": parent, "start_time": lifeline.start_time(parent)}))
    with pytest.raises(lifeline.RunFolderInUseError, match=f"pid {parent}"):
        Children(out / "logs")
