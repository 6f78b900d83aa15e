"""``knit run --ray`` on a real multi-node Ray cluster: 3 hosts (network namespaces), one Ray node each.

Host 1 runs the Ray head with no CPUs (the GCS and the driver only), hosts 2 and 3 a Ray worker node
with 2 CPUs each: ``launcher.ray_deploy`` places one store node on each of them, trainer rank ``r`` on
the ``r``-th, the rollout (the fake engine: no model) on the last. The driver runs inside host 1, so
host 1's link counters bound what it sent and received.

1. A whole run: every acknowledged group trained exactly once, the payload never through host 1.
2. Host 3's store actor killed (SIGKILL, by its pid) mid-run, its Ray node alive: the driver leaves the node out
   of routing, starts it again there from its spill log; then host 3's raylet killed after the last step, before
   the driver collects the stores' metadata: node1 is left out of it for good, and the run ends with status 0,
   every prompt trained once, none dispatched again (``ledger_check``). Host 3 joins again as a new Ray node.
3. Host 3's raylet killed (SIGKILL, by its pid) mid-run, trainer rank 1 with it: the driver stops the run with
   ``RayNodeLostError`` naming host 3's address and what ran there; the groups trained before were
   trained once, and what was not trained is accounted for (``lost_node.json``). Taken up again
   (``resumed``, as ``knit run --resume RUN_DIR --ray``) on host 2 alone, the run ends with every prompt trained
   once (``ledger_exact``).
4. Host 3 back, one trainer rank on host 2: host 3's raylet killed mid-run (its store node and the rollout with it):
   the driver leaves node1 out of the cluster view for good, takes the run up again from the last checkpoint on
   host 2, and the run ends with status 0, every prompt trained once, those host 3 held generated again.

Every Ray process is stopped by pid (``ip netns pids`` of these hosts), and the hosts are removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from launcher.hosts import Host, Hosts, LinkBytes

pytestmark = [pytest.mark.hosts, pytest.mark.ray, pytest.mark.megatron, pytest.mark.slow]

B, G, K = 4, 4, 2
RAY_PORT = 6379
DRIVER = """
import json, sys
from pathlib import Path
from admission.config import AdmissionConfig
from launcher import resume
from launcher.model import trainer_model
from launcher.ray_deploy import RayNodeLostError, run_on_ray
from launcher.run_config import RunConfig
from schemas import run_folder

a = json.loads(sys.argv[1])
out = Path(a["out"])
cfg = RunConfig(admission=AdmissionConfig(train_batch_groups=a["B"], group_size=a["G"], mini_batches=a["K"],
                                          dp_ranks=a["D"], token_budget=4096),
                train_batches=a["batches"], max_tokens=32, idle_timeout_s=90, timeout_s=150, out=out, metrics=False)
if a["resume"]:  # as knit run --resume RUN_DIR --ray: the config the run was started with
    cfg = run_folder.read_run_config(RunConfig, out / "run_config.json")
if a["hold"]:  # the test's moment: every rank returned, the final metadata not collected yet
    import time
    from launcher import ray_deploy
    final = ray_deploy._final_metadata

    def held(*args, **kw):
        print("TRAINED", flush=True)
        while not Path(a["hold"]).exists():
            time.sleep(0.1)
        return final(*args, **kw)

    ray_deploy._final_metadata = held
try:
    result = run_on_ray(cfg, trainer_model(512), address=a["address"], engine="fake", node_loss_grace_s=20,
                        min_nodes=a["nodes"], wait_nodes_s=120, resumed=resume.begin(out) if a["resume"] else None)
except RayNodeLostError as exc:
    print("LOST " + json.dumps({"message": str(exc), "node_ip": exc.node_ip, "components": exc.components}), flush=True)
    sys.exit(3)
print("RESULT " + result.model_dump_json(), flush=True)
"""


@dataclass
class RayCluster:
    hosts: Hosts
    address: str
    env: dict[str, str]
    tmp: Path

    def driver(self, out: Path, batches: int, *, ranks: int = 2, nodes: int = 2, resume: bool = False,
               log: str = "run.log", hold: Path | None = None) -> subprocess.Popen[str]:
        """``run_on_ray`` in a driver process on host 1 (``nodes``: the alive worker nodes it waits for; ``hold``: it
        prints ``TRAINED`` once every rank returned and waits for that file before it collects the metadata)."""
        args = {"B": B, "G": G, "K": K, "D": ranks, "batches": batches, "out": str(out), "address": self.address,
                "resume": resume, "nodes": nodes, "hold": str(hold) if hold else ""}
        with (out.parent / log).open("w") as err:
            return self.hosts[0].popen([sys.executable, "-c", DRIVER, json.dumps(args)], env=self.env,
                                       stdout=subprocess.PIPE, stderr=err, text=True)


def _ray_start(host: Host, args: list[str], env: dict[str, str], log: Path) -> None:
    ray = str(Path(sys.executable).with_name("ray"))
    with log.open("w") as f:  # --block: its process group holds the node
        host.popen([ray, "start", *args, "--node-ip-address", host.address, "--block", "--disable-usage-stats"],
                   env=env, stdout=f, stderr=subprocess.STDOUT)


def _wait_port(address: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(1.0)
            if s.connect_ex((address, port)) == 0:
                return
        time.sleep(0.5)
    pytest.fail(f"the Ray head did not listen on {address}:{port} within {timeout_s} s")


def _stop_in(host: Host) -> None:
    """Every process inside ``host`` (ray start, GCS, raylets, workers), by pid: TERM, then KILL."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        for pid in host.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while host.pids() and time.monotonic() < deadline:
            time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    from launcher.hosts import HostsUnavailableError

    tmp = tmp_path_factory.mktemp("ray")
    env = os.environ | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
                        "RAY_USAGE_STATS_ENABLED": "0",
                        # a lost node is declared dead after ~3 missed 1 s health checks (Ray's default: ~15 s)
                        "RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                        "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "1000",
                        "OMP_NUM_THREADS": "1"}
    try:
        hosts = Hosts(3).__enter__()
    except HostsUnavailableError as exc:
        pytest.skip(f"needs hosts as network namespaces: {exc}")
    try:
        h = hosts.hosts
        _ray_start(h[0], ["--head", "--port", str(RAY_PORT), "--temp-dir", str(tmp / "n1"), "--num-cpus", "0",
                          "--include-dashboard=false"], env, tmp / "n1.log")
        _wait_port(h[0].address, RAY_PORT, 90)
        for i in (1, 2):
            _ray_start(h[i], ["--address", f"{h[0].address}:{RAY_PORT}", "--temp-dir", str(tmp / f"n{i + 1}"),
                              "--num-cpus", "2"], env, tmp / f"n{i + 1}.log")
        yield RayCluster(hosts=hosts, address=f"{h[0].address}:{RAY_PORT}", env=env, tmp=tmp)
    finally:
        for host in reversed(hosts.hosts):  # workers first, the head last
            _stop_in(host)
        hosts.teardown()
        assert not any(host.pids() for host in hosts.hosts)


def _driver_result(proc: subprocess.Popen[str], timeout_s: float) -> tuple[int, str, dict[str, Any]]:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the driver did not finish in {timeout_s} s: {out[-2000:]}")
    line = next((x for x in out.splitlines() if x.startswith(("RESULT ", "LOST "))), "")
    kind, _, body = line.partition(" ")
    return proc.returncode, kind, json.loads(body) if body else {}


def _trained_rows(out: Path) -> list[tuple[int, str, int]]:
    """(step, group, sample) of every row a rank received, from its report (or the side file a killed rank left)."""
    rows = []
    for rank in (0, 1):
        doc, side = out / f"trainer_rank{rank}.json", out / f"trainer_rank{rank}.json.consumed.jsonl"
        entries = json.loads(doc.read_text())["consumed"] if doc.exists() else (
            [json.loads(x) for x in side.read_text().splitlines() if x.strip()] if side.exists() else [])
        rows += [(int(c[1]), str(c[2]), int(c[3])) for c in entries if c[0] == "row"]
    return rows


def test_a_run_on_a_3_node_ray_cluster_trains_every_group_once_and_no_payload_reaches_the_driver(
        ray_cluster: RayCluster, tmp_path: Path) -> None:
    import polars as pl

    h = ray_cluster.hosts.hosts
    batches = 2
    before = {x.address: x.link_bytes() for x in h}
    t0 = time.time()
    code, kind, r = _driver_result(ray_cluster.driver(tmp_path / "run", batches), 240)
    wall = time.time() - t0
    links: dict[str, LinkBytes] = {x.address: x.link_bytes() - before[x.address] for x in h}
    assert (code, kind) == (0, "RESULT"), (tmp_path / "run.log").read_text()[-3000:]
    out = tmp_path / "run"

    # the placement: one store per node with CPUs (hosts 2 and 3), rank r on the r-th, nothing on the head
    placement = r["ray"]["placement"]
    assert placement == {"store node0": h[1].address, "store node1": h[2].address, "rollout": h[2].address,
                         "trainer rank 0": h[1].address, "trainer rank 1": h[2].address}
    stats = json.loads((out / "store_stats.json").read_text())
    assert sorted(loc.split("//")[1].rsplit(":", 1)[0] for loc in stats) == [h[1].address, h[2].address]

    # exactly once: every acknowledged row trained, none twice
    rows = batches * B * G
    assert r["trajectories_consumed"] == r["rows_received"] == rows and r["duplicate_rows"] == 0
    assert r["steps"] == batches * K
    meta, consumed = pl.read_parquet(out / "metadata.parquet"), pl.read_parquet(out / "consumed.parquet")
    keys = ["group_id", "sample_idx"]
    acknowledged = meta.filter(pl.col("status") == "completed").select(keys).sort(keys)
    assert acknowledged.equals(consumed.select(keys).sort(keys)) and meta["released"].all()
    trained = _trained_rows(out)
    assert len(trained) == rows and len({(g, s) for _, g, s in trained}) == rows

    # the payload went between hosts 2 and 3; host 1 (GCS + driver) carried control traffic only
    payload = sum(int(s["bytes_in"]) + int(s["bytes_out"]) for s in stats.values())
    assert r["driver_payload_bytes"] == 0 and set(r["ray"]["driver_bytes"]) == {"actor_returns", "metadata", "stats"}
    assert links[h[2].address].total > payload / 4 > 0  # half the groups and the weights crossed host 3's link
    head = links[h[0].address].total
    assert head < payload / 5, (head, payload)
    print(f"\nray run: {wall:.1f} s; stores' payload in+out {payload} B; host links (B): "
          f"{ {k: (v.rx, v.tx) for k, v in links.items()} }; driver's own bytes {r['ray']['driver_bytes']}")


def _wait_training(driver: subprocess.Popen[str], out: Path, tmp_path: Path) -> None:
    """Until the run's first step is in its progress file (at most 150 s; the driver must not exit first)."""
    deadline = time.monotonic() + 150
    while not ((out / "progress.jsonl").exists() and (out / "progress.jsonl").read_text().strip()):
        assert driver.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the run did not start training"
        time.sleep(0.1)


def test_a_store_actor_killed_mid_run_is_started_again_and_a_node_lost_after_the_last_step_is_left_out(
        ray_cluster: RayCluster, tmp_path: Path) -> None:
    """Host 3's store actor killed mid-run (its node lives: started again), then host 3's raylet killed after the last
    step, before the driver collects the metadata: the run still ends with status 0, node1 left out of the final
    metadata for good, every prompt trained once. Host 3 joins again as a new Ray node for the tests after."""
    import polars as pl
    from ledger_check import ledger_exact

    h = ray_cluster.hosts.hosts
    out, batches, hold = tmp_path / "run", 3, tmp_path / "collect"
    driver = ray_cluster.driver(out, batches, hold=hold)
    try:
        _wait_training(driver, out, tmp_path)
        store = _store_actors(h[2])
        assert len(store) == 1, h[2].pids()
        killed_at = time.time()
        os.kill(store[0], signal.SIGKILL)  # the store node1 actor's process; its Ray node lives on
        assert driver.stdout is not None
        for line in driver.stdout:  # Ray prints its own notices there too; the driver ends its output on exit
            if line.strip() == "TRAINED":
                break
        else:
            pytest.fail(f"the driver exited before its last step: {(tmp_path / 'run.log').read_text()[-3000:]}")
        lost_at = _kill_raylet(h[2])  # training is done: the stores' metadata is all the driver still needs of node1
        deadline = time.monotonic() + 30
        while _store_actors(h[2]):  # the workers follow their raylet: node1's store with them
            assert time.monotonic() < deadline, "node1's store outlived its raylet by 30 s"
            time.sleep(0.1)
        hold.touch()
        code, kind, r = _driver_result(driver, 200)
        assert (code, kind) == (0, "RESULT"), (tmp_path / "run.log").read_text()[-3000:]
        restarted, gone = r["store_outages"]
        assert restarted["node"] == "node1" and restarted["back_at"] > restarted["died_at"] >= killed_at - 0.1
        assert gone["node"] == "node1" and gone["lost_at"] > lost_at and gone["back_at"] is None
        assert len(r["ray"]["lost"]) == 1
        assert r["steps"] == batches * K and r["trajectories_consumed"] == batches * B * G
        assert ledger_exact(out, prompts=batches * B) == {}  # each prompt trained once, nothing went out again
        trained = _trained_rows(out)
        assert len(trained) == batches * B * G and len({(g, i) for _, g, i in trained}) == len(trained)
        stats = json.loads((out / "store_stats.json").read_text())
        assert list(stats) and [loc for loc in stats if h[2].address in loc] == []  # node1's store: gone with its node
        meta = pl.read_parquet(out / "metadata.parquet")  # node0's metadata only: node1's went with its node
        assert meta.height and all(h[1].address in n for n in meta["node"].unique().to_list())
        log = (tmp_path / "run.log").read_text()
        assert "cluster view v2: nodes down ['node1']" in log and "cluster view v3: nodes down none" in log
        assert "was lost after the last step" in log
        print(f"\nstore actor killed at 0: found +{restarted['died_at'] - killed_at:.2f} s, back "
              f"+{restarted['back_at'] - killed_at:.2f} s; raylet killed after the last step, node1 left out "
              f"+{gone['lost_at'] - lost_at:.1f} s after")
    finally:
        if driver.poll() is None:  # a failed check left it running
            os.killpg(driver.pid, signal.SIGKILL)
            driver.communicate()
        _stop_in(h[2])  # what the raylet killed left there; host 3 back as a new Ray node for the tests after
        _ray_start(h[2], ["--address", ray_cluster.address, "--temp-dir", str(ray_cluster.tmp / "n3a"), "--num-cpus",
                          "2"], ray_cluster.env, ray_cluster.tmp / "n3a.log")


def _store_actors(host: Host) -> list[int]:
    """The pids of the store node actors in ``host``."""
    out = []
    for p in host.pids():
        with contextlib.suppress(OSError):  # gone meanwhile
            if b"StoreNodeActor" in Path(f"/proc/{p}/cmdline").read_bytes():
                out.append(p)
    return out


def _kill_raylet(host: Host) -> float:
    """SIGKILL of ``host``'s raylet (its workers follow it); returns when."""
    raylet = [p for p in host.pids() if Path(f"/proc/{p}/comm").read_text().strip() == "raylet"]
    assert len(raylet) == 1, host.pids()
    killed_at = time.time()
    os.kill(raylet[0], signal.SIGKILL)
    return killed_at


def test_a_ray_node_lost_with_a_trainer_rank_stops_the_run_with_a_typed_error_and_a_resume_finishes_it(
        ray_cluster: RayCluster, tmp_path: Path) -> None:
    import polars as pl
    from ledger_check import ledger_exact

    h = ray_cluster.hosts.hosts
    out = tmp_path / "run"
    batches = 8  # still running when the raylet is killed (4 were done before it once)
    driver = ray_cluster.driver(out, batches)
    _wait_training(driver, out, tmp_path)
    killed_at = _kill_raylet(h[2])  # host 3's Ray node is gone, trainer rank 1 with it
    code, kind, lost = _driver_result(driver, 120)
    ended_at = time.time()
    assert (code, kind) == (3, "LOST"), (tmp_path / "run.log").read_text()[-3000:]
    assert lost["node_ip"] == h[2].address and h[2].address in lost["message"]
    assert sorted(lost["components"]) == ["rollout", "store node1", "trainer rank 1"]

    accounting = json.loads((out / "lost_node.json").read_text())
    assert accounting["node_ip"] == h[2].address and accounting["groups_lost_unconsumed"] >= 0
    assert killed_at < accounting["detected_at"] < ended_at
    steps = [json.loads(x) for x in (out / "progress.jsonl").read_text().splitlines() if x.strip()]
    assert 1 <= len(steps) < batches * K  # killed mid-run

    # what was trained was trained once; the surviving store's released groups were all trained
    trained = _trained_rows(out)
    assert trained and len({(g, s) for _, g, s in trained}) == len(trained)
    meta = pl.read_parquet(out / "metadata.parquet")  # the surviving node's (node0's) metadata only
    assert all(h[1].address in n for n in meta["node"].unique().to_list())
    released = {(g, s) for g, s in meta.filter(pl.col("released")).select("group_id", "sample_idx").iter_rows()}
    assert released <= {(g, s) for _, g, s in trained}

    # taken up again on the node left: node1's groups not trained go out again, each prompt trained once
    code, kind, r = _driver_result(ray_cluster.driver(out, batches, nodes=1, resume=True, log="resume.log"), 240)
    assert (code, kind) == (0, "RESULT"), (tmp_path / "resume.log").read_text()[-3000:]
    assert r["steps"] == batches * K and r["ray"]["placement"]["trainer rank 1"] == h[1].address
    again = ledger_exact(out, prompts=batches * B)
    (seam,) = r["resumes"]
    # (a step's checkpoint is written before the publisher appends its progress line: one more than those read)
    assert seam["step"] <= len(steps) + 1 and set(again) <= {"node_lost", "interrupted", "rolled_back", "aborted"}
    print(f"\nlost node {lost['node_ip']}: raylet killed at 0; detected +{accounting['detected_at'] - killed_at:.1f} s "
          f"({accounting['cause']}); driver exited +{ended_at - killed_at:.1f} s after {len(steps)} steps; resumed "
          f"from step {seam['step']}, first step {seam['first_step_s']} s after launch; dispatched again {again}")


def test_a_ray_node_lost_with_a_store_and_the_rollout_is_survived_every_prompt_trained_once(
        ray_cluster: RayCluster, tmp_path: Path) -> None:
    from ledger_check import ledger_exact

    h = ray_cluster.hosts.hosts
    _stop_in(h[2])  # what the raylet killed before left there
    _ray_start(h[2], ["--address", ray_cluster.address, "--temp-dir", str(ray_cluster.tmp / "n3b"), "--num-cpus", "2"],
               ray_cluster.env, ray_cluster.tmp / "n3b.log")  # host 3 back as a new Ray node
    out, batches = tmp_path / "run", 10  # one rank's steps are quick: still running when the loss is noticed
    driver = ray_cluster.driver(out, batches, ranks=1)
    _wait_training(driver, out, tmp_path)
    killed_at = _kill_raylet(h[2])  # store node1 and the rollout; trainer rank 0 is on host 2
    code, kind, r = _driver_result(driver, 240)
    assert (code, kind) == (0, "RESULT"), (tmp_path / "run.log").read_text()[-3000:]
    assert r["steps"] == batches * K and r["trajectories_consumed"] == batches * B * G
    (outage,) = r["store_outages"]
    assert outage["node"] == "node1" and outage["lost_at"] > killed_at and outage["back_at"] is None
    assert len(r["ray"]["lost"]) == 1 and r["ray"]["placement"]["rollout"] == h[1].address  # the new life's rollout
    (seam,) = r["resumes"]
    assert seam["cause"] == "node_lost" and seam["step"] < batches * K
    again = ledger_exact(out, prompts=batches * B)
    assert set(again) <= {"node_lost", "interrupted", "rolled_back", "aborted"}
    assert "nodes down ['node1']" in (tmp_path / "run.log").read_text()
    print(f"\nnode lost for good with store node1 and the rollout: +{outage['lost_at'] - killed_at:.1f} s; taken up "
          f"from step {seam['step']}, first step {seam['first_step_s']} s after; dispatched again {again}")


OWNER = """
import json, os, sys, time
import ray
from flight_store.config import ServerConfig
from launcher import ray_actors

address, want = sys.argv[1], int(sys.argv[2])
ray.init(address=address, log_to_driver=False, _node_ip_address=ray_actors.local_ip_towards(address))
deadline = time.monotonic() + 120
while True:  # every worker node joined (a node a test before took down is listed dead)
    nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
    if len(nodes) + sum(not n["Alive"] for n in ray.nodes()) >= want:
        break
    assert time.monotonic() < deadline, ray.nodes()
    time.sleep(0.5)
actors = [ray_actors.pinned(ray, ray_actors.StoreNodeActor, n["NodeID"], 0.5).remote(n["NodeManagerAddress"])
          for n in nodes]
locations = ray.get([a.start.remote(ServerConfig(host=n["NodeManagerAddress"], log_level="WARNING"))
                     for a, n in zip(actors, nodes)])
pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in actors])
print("READY " + json.dumps({"pids": pids, "locations": locations}), flush=True)
time.sleep(600)
"""
"""A driver that starts a store node actor on each alive node with CPUs (once ``argv[2]`` worker nodes joined) as
``knit run --ray`` does, then waits."""


def _store_answers(location: str) -> bool:
    from launcher.stores import answers

    try:
        return answers(location)
    except Exception:  # nothing, or something else, listens there
        return False


def test_the_store_actors_of_a_killed_driver_end_with_it(ray_cluster: RayCluster, tmp_path: Path) -> None:
    """SIGKILL of the driver alone: within 10 s no store node actor of it runs and none answers on its port (Ray
    ends the actors an owner that died leaves: ``launcher.ray_deploy`` starts none detached)."""
    from launcher.lifeline import start_time

    workers = len(ray_cluster.hosts.hosts) - 1  # the head has no CPUs
    with (tmp_path / "owner.log").open("w") as err:
        owner = ray_cluster.hosts[0].popen([sys.executable, "-c", OWNER, ray_cluster.address, str(workers)],
                                           env=ray_cluster.env, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        assert line.startswith("READY "), (tmp_path / "owner.log").read_text()[-3000:]
        ready = json.loads(line.removeprefix("READY "))
        started = {pid: start_time(pid) for pid in ready["pids"]}
        assert ready["pids"] and all(started.values())
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        deadline = time.monotonic() + 10.0
        while any(start_time(p) == s for p, s in started.items()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p, s in started.items() if start_time(p) == s], "store actors outlived their driver"
        # no store node answers on their ports (a port freed may be bound again by another process of the node)
        assert not [loc for loc in ready["locations"] if _store_answers(loc)], "a store node still answers"
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()
