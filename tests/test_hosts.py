"""The system across hosts on a real network stack: hosts are network namespaces on a bridge (``launcher.hosts``).

Harness tests (``hosts``): addresses, byte counters that follow the real path of the traffic, a cut link that
drops packets until restored while an established connection survives it, teardown that always runs (an
exception, Ctrl-C, a process the harness did not start), a typed error where namespaces cannot be made; and
``launcher.stores`` recording a store host cut off (its process runs, it does not answer) as an outage.

Placement tests (no hosts): ``Site``/``Placement`` validation, store configs that bind and advertise their
site's address (loopback unchanged by default), trainer ranks started one per site with their rendezvous.

The loop (``hosts``, ``megatron``, ``vllm``, ``slow``): ``knit run``'s ``run_policy`` with a placement over 4
hosts; host 1: store node0 + the vLLM rollout worker, host 2: store node1, hosts 3 and 4: trainer ranks 0
and 1 (one process each, gloo across the hosts); this test process is the driver, in the root namespace,
reaching the hosts over the bridge (its link). One run serves three tests (2 cores: one vLLM start): once
training runs, store node0's process on host 1 is SIGKILLed (the driver starts it again there from its
spill log), then host 2's link is taken down for a few seconds. Checked: every acknowledged group trained
exactly once, nothing lost, the payload on the links that should carry it and the driver's link far below
it, and the report's outage records.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flight_store.config import ServerConfig
from launcher.children import Children
from launcher.hosts import RANGE, Hosts, HostsUnavailableError, LinkBytes
from launcher.placement import Placement, Site
from launcher.run import start_trainer
from launcher.run_config import RunConfig, store_configs
from launcher.stores import Stores

SINK = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
conn, _ = srv.accept()
n = 0
while chunk := conn.recv(65536):
    n += len(chunk)
print(n, flush=True)
"""
"""A TCP server in a host: counts the bytes of one connection and prints the count at its end."""


def _ip_names() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout + \
        subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=False).stdout


def _sink(host: Any, port: int) -> subprocess.Popen[str]:
    proc = host.popen([sys.executable, "-c", SINK, host.address, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


# ---- the harness ----------------------------------------------------------------------------------


@pytest.mark.hosts
def test_hosts_have_their_own_addresses_and_count_the_bytes_of_their_links(make_hosts) -> None:  # type: ignore[no-untyped-def]
    hosts, other = make_hosts(3), make_hosts(1)
    addrs = [ipaddress.ip_address(h.address) for h in hosts]
    assert all(a in RANGE for a in addrs) and len(set(addrs)) == 3
    assert ipaddress.ip_address(hosts.driver_address) in ipaddress.ip_network(f"{hosts[0].address}/24", strict=False)
    assert ipaddress.ip_address(other.driver_address) in RANGE
    assert other.driver_address != hosts.driver_address  # two instances: two /24s, two sets of names
    assert {h.netns for h in hosts}.isdisjoint({h.netns for h in other}) and hosts.bridge != other.bridge
    assert all(len(h.link) <= 15 for h in hosts) and len(hosts.bridge) <= 15

    sink = _sink(hosts[0], 7100)
    before = [h.link_bytes() for h in hosts]
    driver_before = hosts.driver_bytes()
    payload = 400_000
    send = f"import socket; s = socket.create_connection(('{hosts[0].address}', 7100)); s.sendall(b'x' * {payload})"
    assert hosts[1].popen([sys.executable, "-c", send]).wait(timeout=30) == 0
    out, _ = sink.communicate(timeout=30)
    assert int(out) == payload
    moved = [h.link_bytes() - b for h, b in zip(hosts, before, strict=True)]
    driver = hosts.driver_bytes() - driver_before
    assert moved[0].rx >= payload and moved[1].tx >= payload  # host 2 -> host 1 over their own links ...
    assert moved[0].tx < payload // 10 and moved[1].rx < payload // 10  # ... (acks back)
    assert moved[2].total < 5_000 and driver.total < 5_000  # ... and past the others: the bridge switches it


@pytest.mark.hosts
def test_a_cut_link_drops_packets_until_restored_and_a_connection_survives_it(make_hosts) -> None:  # type: ignore[no-untyped-def]
    hosts = make_hosts(2)
    sink = _sink(hosts[0], 7101)
    writer = hosts[1].popen([sys.executable, "-c", (
        "import socket, sys, time\n"
        f"s = socket.create_connection(('{hosts[0].address}', 7101))\n"
        "s.sendall(b'a' * 1000); print('sent', flush=True)\n"
        "sys.stdin.readline(); s.sendall(b'b' * 1000); print('sent', flush=True)\n")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert writer.stdout is not None and writer.stdin is not None
    assert writer.stdout.readline().strip() == "sent"
    hosts[0].cut()
    try:
        with pytest.raises(OSError):  # nobody reaches host 1: a new connection times out
            socket.create_connection((hosts[0].address, 7101), timeout=1.0)
        writer.stdin.write("go\n")
        writer.stdin.flush()  # the established connection sends into the cut: TCP keeps it and resends
        assert writer.stdout.readline().strip() == "sent"
        time.sleep(1.0)
    finally:
        hosts[0].restore()
    writer.stdin.close()
    assert writer.wait(timeout=30) == 0
    writer.stdout.close()
    out, _ = sink.communicate(timeout=30)
    assert int(out) == 2000  # everything arrived once the link was back


@pytest.mark.hosts
@pytest.mark.parametrize("failure", [RuntimeError, KeyboardInterrupt])
def test_teardown_always_runs_and_stops_what_runs_inside(failure: type[BaseException]) -> None:
    names: list[str] = []
    with pytest.raises(failure), Hosts(2) as hosts:
        names = [h.netns for h in hosts] + [h.link for h in hosts] + [hosts.bridge]
        tracked = hosts[0].popen(["sleep", "600"])
        # started by someone else inside host 2 (a launcher's child): teardown finds it by `ip netns pids`
        stray = subprocess.Popen([*hosts[1].exec_prefix, "sleep", "600"], start_new_session=True)
        deadline = time.monotonic() + 10
        while stray.pid not in hosts[1].pids():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        raise failure("boom")
    assert tracked.poll() is not None
    assert stray.wait(timeout=10) is not None
    listing = _ip_names()
    assert not [n for n in names if n in listing], listing
    hosts.teardown()  # idempotent


@pytest.mark.hosts
def test_what_a_killed_run_left_behind_is_swept_and_live_runs_are_not(make_hosts) -> None:  # type: ignore[no-untyped-def]
    from launcher.hosts import sweep_stale

    dead = next(pid for pid in range(4_000_000, 4_100_000) if not Path(f"/proc/{pid}").exists())
    ns, bridge = f"k{dead}x0h1", f"k{dead}x0b"
    live = make_hosts(1)  # this process's: must stay
    subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(["ip", "link", "add", bridge, "type", "bridge"], check=True)
    orphan = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "600"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while str(orphan.pid) not in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                                    check=False).stdout.split():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert sorted(sweep_stale()) == sorted([ns, bridge])
        assert orphan.wait(timeout=10) == -9  # the process left inside was stopped, by its pid
        listing = _ip_names()
        assert ns not in listing and bridge not in listing
        assert live[0].netns in listing and live.bridge in listing
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, check=False)
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()


def test_no_hosts_where_namespaces_cannot_be_made_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import launcher.hosts as mod

    with pytest.raises(ValueError, match="n=0"):
        Hosts(0)
    monkeypatch.setattr(mod.sys, "platform", "linux")
    monkeypatch.setattr(mod.shutil, "which", lambda _name: "ip")
    monkeypatch.setattr(mod.os, "geteuid", lambda: 1000)
    with pytest.raises(HostsUnavailableError, match=r"needs root .* uid 1000"):
        Hosts(2).__enter__()
    monkeypatch.setattr(mod.shutil, "which", lambda _name: None)
    with pytest.raises(HostsUnavailableError, match="iproute2"):
        mod.check_available()
    assert LinkBytes(rx=5, tx=7) - LinkBytes(rx=1, tx=2) == LinkBytes(rx=4, tx=5)


@pytest.mark.hosts
def test_a_store_host_cut_off_is_recorded_as_unreachable_and_back(make_hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    hosts = make_hosts(1)
    placement = Placement(stores=[hosts[0].site()], rollout=Site(), trainer=[Site()])
    cfg = RunConfig(num_stores=1, metrics=False, out=tmp_path)
    with Children(tmp_path / "logs") as kids:
        stores = Stores(kids, store_configs(cfg, placement), tmp_path, max_restarts=0, start_timeout_s=30,
                        sites=placement.stores, probe_s=0.2)
        stores.start()
        try:
            assert stores.locations[0].startswith(f"grpc://{hosts[0].address}:")
            assert stores.check() == []
            hosts[0].cut()
            cut_at = time.time()
            deadline = time.monotonic() + 10
            while not stores.check():
                assert time.monotonic() < deadline, "the cut-off node was not found unreachable"
                time.sleep(0.05)
            found_at = time.time()
            time.sleep(1.5)
            assert stores.check() == ["node0"]  # still cut off: one outage, nothing restarted
            hosts[0].restore()
            restored_at = time.time()
            stores.wait_up()
        finally:
            stores.close()
        (outage,) = stores.outages
        assert outage.cause == "unreachable" and outage.restarts == 0 and outage.exit_code is None
        assert stores.children[0].restarts == 0 and stores.children[0].alive()  # the process ran throughout
        assert cut_at - 1.0 <= outage.died_at <= cut_at + 2  # (a probe sent just before the cut may miss)
        assert outage.back_at is not None and restored_at <= outage.back_at <= restored_at + 10
        assert outage.died_at <= found_at < restored_at <= outage.back_at  # one outage spans the whole cut
        assert outage.record().cause == "unreachable"


def test_a_store_host_cut_off_longer_than_the_start_timeout_is_lost_for_good(make_hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    hosts = make_hosts(2)
    placement = Placement(stores=[h.site() for h in hosts], rollout=Site(), trainer=[Site()])
    cfg = RunConfig(num_stores=2, metrics=False, out=tmp_path)
    with Children(tmp_path / "logs") as kids:
        stores = Stores(kids, store_configs(cfg, placement), tmp_path, max_restarts=3, start_timeout_s=60,
                        sites=placement.stores, probe_s=0.2)
        stores.start()  # a loaded machine may take seconds to start a node: the short bound is for the outage
        stores.start_timeout_s = 3
        try:
            hosts[1].cut()
            deadline = time.monotonic() + 20
            while not stores.lost:
                assert time.monotonic() < deadline, "the cut-off node was never given up"
                stores.check()
                time.sleep(0.05)
            hosts[1].restore()  # its link is back, but it is lost: its process was stopped, it stays down
            time.sleep(1.0)
            assert stores.check() == ["node1"] and stores.lost == ["node1"]
            stores.wait_up()  # node0 answers
        finally:
            stores.close()
        (outage,) = stores.outages
        assert outage.cause == "unreachable" and outage.back_at is None and outage.lost_at is not None
        assert outage.lost_at - outage.died_at >= 3  # given up only after the start timeout
        assert not stores.children[1].alive() and stores.children[1].restarts == 0
        assert stores.views is not None and stores.views.down == {"node1"}


def test_a_resume_goes_on_without_a_silent_store(make_hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A store host cut off when the stores start: a fresh start fails naming it; a resume goes on without it until
    it answers. Found by the chaos run: a launcher killed while a store host was cut off could not be taken up (its
    start waited for every node, then blamed node 0)."""
    hosts = make_hosts(2)
    placement = Placement(stores=[h.site() for h in hosts], rollout=Site(), trainer=[Site()])
    cfg = RunConfig(num_stores=2, metrics=False, out=tmp_path)

    def stores_of(kids: Children) -> Stores:
        return Stores(kids, store_configs(cfg, placement), tmp_path, max_restarts=1, start_timeout_s=15,
                      sites=placement.stores, probe_s=0.2)

    hosts[1].cut()
    try:
        with Children(tmp_path / "logs") as kids:
            stores = stores_of(kids)
            with pytest.raises(RuntimeError, match=r"store node\(s\) (store0, )?store1 did not come up"):
                stores.start()  # a fresh start needs every node
            stores.close()
        with Children(tmp_path / "logs") as kids:
            stores = stores_of(kids)
            stores.start(fresh=False)  # a resume goes on with node0; node1 is an outage from its start
            try:
                (outage,) = stores.outages
                assert (outage.store, outage.cause, outage.lost_at) == ("store1", "unreachable", None)
                assert stores.views is not None and stores.views.down == {"node1"}
                hosts[1].restore()
                deadline = time.monotonic() + 30
                while outage.back_at is None:  # the prober finds it answering again
                    assert time.monotonic() < deadline, "the node was never found back"
                    stores.check()
                    time.sleep(0.1)
                assert stores.check() == [] and stores.views.down == set()
            finally:
                stores.close()
    finally:
        hosts[1].restore()


def test_probes_do_not_take_a_restarted_node_for_an_unreachable_one(tmp_path: Path) -> None:
    import signal

    cfg = RunConfig(num_stores=1, metrics=False, out=tmp_path)
    with Children(tmp_path / "logs") as kids:  # probe rounds run here, one at a time (no prober thread)
        stores = Stores(kids, store_configs(cfg), tmp_path, max_restarts=1, start_timeout_s=30)
        stores.start()
        try:
            stores.probe_once()  # the probe now holds a connection to the node
            assert stores.outages == []
            os.kill(stores.children[0].pid, signal.SIGKILL)
            stores.children[0].proc.wait(timeout=10)
            stores.probe_once()  # its process exited: that is an exit for check(), not an unreachable node
            assert stores.outages == []
            stores.wait_up()  # started again on its port, from its spill log
            stores.probe_once()  # the probe's old connection saw the node die: no outage of a node that answers
            stores.probe_once()
            assert stores.check() == []
        finally:
            stores.close()
    (outage,) = stores.outages
    assert outage.cause == "exited" and outage.restarts == 1 and outage.exit_code == -signal.SIGKILL


# ---- placement (no hosts) -------------------------------------------------------------------------


def test_a_placement_names_the_rollouts_home_stores_and_the_hosts_of_nodes_and_ranks() -> None:
    from admission.config import LinkModel

    a, b, c = (Site(address=f"198.18.0.{i}", exec_prefix=["ip", "netns", "exec", f"h{i}"]) for i in (2, 3, 4))
    p = Placement(stores=[a, b], rollout=b, trainer=[a, c])
    assert p.home_stores() == [1]  # the rollout shares b's host: its groups stay on node 1
    links = p.link_model(["grpc://n0", "grpc://n1"], 2, LinkModel(default_mbit=200.0))
    assert links.host_of_node("grpc://n0") == links.host_of_rank(0) != links.host_of_rank(1)
    assert links.host_of_node("grpc://n1") not in (links.host_of_rank(0), links.host_of_rank(1))
    assert links.default_mbit == 200.0  # the rates are the user's
    mine = LinkModel(rank_host=("x", "y"))
    assert p.link_model(["grpc://n0", "grpc://n1"], 2, mine) is mine  # hosts the user named are kept
    assert Placement.local(2).home_stores() == [0, 1]
    assert Placement(stores=[a], rollout=c, trainer=[c]).home_stores() == []  # a rollout host of its own: hashed


def test_sites_and_placements_are_checked() -> None:
    with pytest.raises(ValueError, match="must be an IP address"):
        Site(address="localhost")
    with pytest.raises(ValueError, match="unspecified"):
        Site(address="0.0.0.0")
    with pytest.raises(ValueError, match="exec_prefix"):
        Site(exec_prefix=[""])
    with pytest.raises(ValueError, match="master_port"):
        Placement(stores=[Site()], rollout=Site(), trainer=[Site()], master_port=0)
    with pytest.raises(ValueError, match="probe_s"):
        Placement(stores=[Site()], rollout=Site(), trainer=[Site()], probe_s=0)
    with pytest.raises(ValueError, match="2 store sites for num_stores=3"):
        Placement.local(2).check(num_stores=3, dp_ranks=2)
    with pytest.raises(ValueError, match="3 trainer sites"):
        Placement(stores=[Site()], rollout=Site(), trainer=[Site()] * 3).check(num_stores=1, dp_ranks=2)
    with pytest.raises(ValueError, match="advertise_host"):
        ServerConfig(advertise_host="0.0.0.0")
    any_if = ServerConfig(host="0.0.0.0", advertise_host="198.18.0.5", port=9)
    assert (any_if.location, any_if.bind_location) == ("grpc://198.18.0.5:9", "grpc://0.0.0.0:9")
    assert ServerConfig(port=9).location == ServerConfig(port=9).bind_location == "grpc://127.0.0.1:9"


def test_a_node_bound_to_every_interface_advertises_the_address_given(store_nodes) -> None:  # type: ignore[no-untyped-def]
    from flight_store.client import StoreAdmin

    (node,) = store_nodes(1, ServerConfig(host="0.0.0.0", advertise_host="127.0.0.1"))
    assert node.location.startswith("grpc://127.0.0.1:")
    with StoreAdmin(node.location) as client:
        assert client.health()[node.location].ok


def test_store_configs_bind_and_advertise_their_sites(tmp_path: Path) -> None:
    cfg = RunConfig(out=tmp_path)
    default = store_configs(cfg)
    assert [c.host for c in default] == ["127.0.0.1", "127.0.0.1"]  # knit run without a placement: loopback
    assert all(m.location.startswith("grpc://127.0.0.1:") for m in default[0].cluster)
    sites = [Site(address="198.18.0.1", exec_prefix=["x"]), Site(address="198.18.0.2", exec_prefix=["x"])]
    placed = store_configs(cfg, Placement(stores=sites, rollout=Site(), trainer=[Site()]))
    assert [c.host for c in placed] == ["198.18.0.1", "198.18.0.2"]
    assert [c.location for c in placed] == [m.location for m in placed[0].cluster]
    assert placed[1].location.startswith("grpc://198.18.0.2:") and placed[1].advertise_host is None
    # every node's port and metrics port on one address are distinct: asked together, never one after another
    # (two asks in a row can get one port back; a run once started both of its nodes on the same port)
    many = store_configs(RunConfig(out=tmp_path, num_stores=8))
    ports = [p for c in many for p in (c.port, c.metrics_port)]
    assert None not in ports and len(set(ports)) == 16


def test_trainer_ranks_apart_get_their_rank_and_rendezvous(tmp_path: Path) -> None:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")
    show = (f"import json, os, sys; print(json.dumps({{'argv': sys.argv[1:], "
            f"'env': {{k: os.environ.get(k) for k in {keys}}}}}))")
    sites = [Site(address=f"198.18.0.{i}", exec_prefix=[sys.executable, "-c", show], env={"GLOO_SOCKET_IFNAME": "e"})
             for i in (3, 4)]
    placement = Placement(stores=[Site()], rollout=Site(), trainer=sites, master_port=29611)
    with Children(tmp_path / "logs") as kids:
        ranks = start_trainer(kids, placement, tmp_path / "train.json", dp_ranks=2)
        assert [r.proc.wait(timeout=30) for r in ranks] == [0, 0]
    seen = [json.loads((tmp_path / "logs" / f"trainer{r}.log").read_text()) for r in (0, 1)]
    for r, s in enumerate(seen):
        assert s["argv"] == [sys.executable, "-m", "train", "--config", str(tmp_path / "train.json")]  # no --nproc
        assert s["env"] == {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                            "MASTER_ADDR": "198.18.0.3", "MASTER_PORT": "29611", "GLOO_SOCKET_IFNAME": "e"}
    with Children(tmp_path / "logs1") as kids:
        (one,) = start_trainer(kids, Placement(stores=[Site()], rollout=Site(), trainer=[sites[0]]),
                               tmp_path / "train.json", dp_ranks=2)
        assert one.name == "trainer" and one.proc.wait(timeout=30) == 0
    assert json.loads((tmp_path / "logs1" / "trainer.log").read_text())["argv"][-2:] == ["--nproc", "2"]


# ---- the loop across hosts ------------------------------------------------------------------------

B, G, K, BATCHES = 4, 4, 2, 6
CUT_S = 6.0
"""Seconds host 2 (store node1) is cut off, once training runs (after store node0 on host 1 was SIGKILLed and is
back from its spill log)."""


@dataclass
class HostsRun:
    result: dict[str, Any]
    links: dict[str, LinkBytes]
    out: Path
    addresses: dict[str, str]
    cut_at: float
    restored_at: float
    wall_s: float
    killed_at: float
    killed_pid: int


def _child(out: Path, name: str) -> dict[str, Any]:
    """The driver's record of one child (``logs/children.json``: its current pid and restarts)."""
    try:
        children = json.loads((out / "logs" / "children.json").read_text())
    except (OSError, ValueError):  # not written yet, or being rewritten
        return {"pid": 0, "restarts": 0}
    return dict(next(c for c in children if c["name"] == name))


@pytest.fixture(scope="module")
def hosts_run(tmp_path_factory: pytest.TempPathFactory) -> HostsRun:
    from admission.config import AdmissionConfig
    from launcher.model import prepare_model
    from launcher.run import run_policy

    model_dir = tmp_path_factory.mktemp("model") / "tiny-llama"
    model = prepare_model(model_dir)
    out = tmp_path_factory.mktemp("hosts-run")
    cfg = RunConfig(admission=AdmissionConfig(train_batch_groups=B, group_size=G, mini_batches=K, dp_ranks=2,
                                              token_budget=4096),
                    train_batches=BATCHES, max_tokens=32, timeout_s=240, out=out, model_dir=model_dir,
                    placement="hash")  # both nodes hold groups, so reads cross both store hosts' links
    with Hosts(4) as hosts:
        h = hosts.hosts
        placement = Placement(stores=[h[0].site(), h[1].site()], rollout=h[0].site(),
                              trainer=[h[2].site(), h[3].site()], probe_s=1.0)
        before = {f"host{x.index}": x.link_bytes() for x in h} | {"driver": hosts.driver_bytes()}
        stop, result, errors = threading.Event(), {}, []

        def run() -> None:
            try:
                result.update(run_policy(cfg, model, stop=stop, placement=placement).model_dump())
            except BaseException as exc:  # reported by the test
                errors.append(exc)

        t0 = time.time()
        driver = threading.Thread(target=run, name="knit-run-driver")
        driver.start()
        cut_at = restored_at = killed_at = 0.0
        killed_pid = 0
        try:
            deadline = time.monotonic() + 180
            while not (out / "progress.jsonl").exists() and driver.is_alive():
                assert time.monotonic() < deadline, "the run did not start training"
                time.sleep(0.05)
            if driver.is_alive():  # store node0's process on host 1 is SIGKILLed; the driver restarts it there
                killed_pid = _child(out, "store0")["pid"]
                os.kill(killed_pid, signal.SIGKILL)
                killed_at = time.time()
                while _child(out, "store0")["restarts"] < 1 and driver.is_alive():
                    assert time.monotonic() < deadline + 60, "the killed store was not started again"
                    time.sleep(0.05)
            if driver.is_alive():
                h[1].cut()  # store node1's host is cut off mid-run
                cut_at = time.time()
                try:
                    time.sleep(CUT_S)
                finally:
                    h[1].restore()
                    restored_at = time.time()
            driver.join(timeout=240)
        finally:
            if driver.is_alive():
                stop.set()  # the driver stops every child
                driver.join(timeout=90)
        links = {k: (hosts.driver_bytes() if k == "driver" else h[int(k[4:]) - 1].link_bytes()) - v
                 for k, v in before.items()}
        addresses = {f"host{x.index}": x.address for x in h} | {"driver": hosts.driver_address}
    assert not errors, f"knit run across hosts failed: {errors[0]!r}"
    run_ = HostsRun(result=result, links=links, out=out, addresses=addresses, cut_at=cut_at,
                    restored_at=restored_at, wall_s=time.time() - t0, killed_at=killed_at, killed_pid=killed_pid)
    print("\nper-link bytes (rx/tx seen from each end):",
          {k: (v.rx, v.tx) for k, v in links.items()}, f"wall {run_.wall_s:.1f} s")
    return run_


@pytest.mark.hosts
@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.slow
def test_across_hosts_every_group_is_trained_once_and_payload_skips_the_driver(hosts_run: HostsRun) -> None:
    import polars as pl

    r, out, links = hosts_run.result, hosts_run.out, hosts_run.links
    rows = BATCHES * B * G
    assert r["trajectories_consumed"] == r["rows_received"] == rows and r["duplicate_rows"] == 0
    assert r["steps"] == BATCHES * K and r["final_version"] == BATCHES * K
    assert r["rollout"]["groups"] == BATCHES * B and r["rollout"]["aborted_groups"] == 0
    meta, consumed = pl.read_parquet(out / "metadata.parquet"), pl.read_parquet(out / "consumed.parquet")
    keys = ["group_id", "sample_idx"]
    assert meta.select(keys).is_unique().all() and consumed.select(keys).is_unique().all()
    acknowledged = meta.filter(pl.col("status") == "completed").select(keys).sort(keys)
    assert acknowledged.equals(consumed.select(keys).sort(keys))  # every acknowledged row trained, once

    # every process ran on its host, and the stores bound and advertised their hosts' addresses
    children = {c["name"]: c for c in json.loads((out / "logs" / "children.json").read_text())}
    assert sorted(children) == ["rollout", "store0", "store1", "trainer0", "trainer1"]
    for name, host in [("store0", 1), ("rollout", 1), ("store1", 2), ("trainer0", 3), ("trainer1", 4)]:
        assert children[name]["cmd"][:3] == ["ip", "netns", "exec"] and children[name]["cmd"][3].endswith(f"h{host}")
    node_host = {"node0": hosts_run.addresses["host1"], "node1": hosts_run.addresses["host2"]}
    stats = json.loads((out / "store_stats.json").read_text())
    assert {s["node"]: loc.split("//")[1].rsplit(":", 1)[0] for loc, s in stats.items()} == node_host
    assert sorted(meta["node"].unique().to_list()) == sorted(stats)  # both nodes held groups
    assert [u.split("//")[1].rsplit(":", 1)[0] for u in r["metrics_urls"]] == list(node_host.values())

    # the payload went from the storing host to the training host over their links ...
    ranks = r["bytes_per_rank"]
    assert links["host3"].rx >= ranks["0"] > 0 and links["host4"].rx >= ranks["1"] > 0
    node1 = next(s for s in stats.values() if s["node"] == "node1")
    assert links["host2"].tx >= node1["bytes_out"] > 0  # what node1 served left over host 2's link
    # ... and the driver's link carried metadata and stats only: far below the payload the stores moved
    payload = sum(int(s["bytes_in"]) + int(s["bytes_out"]) for s in stats.values())
    driver = links["driver"].total
    assert driver < payload / 20, (driver, payload)
    print(f"\ntrajectory payload to ranks {sum(ranks.values())} B, stores' payload in+out {payload} B, "
          f"driver link {driver} B ({driver / hosts_run.wall_s:.0f} B/s over {hosts_run.wall_s:.1f} s)")


@pytest.mark.hosts
@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.slow
def test_a_store_host_cut_off_mid_run_the_run_goes_on_and_the_report_shows_it(hosts_run: HostsRun) -> None:
    r, out = hosts_run.result, hosts_run.out
    assert hosts_run.cut_at > 0, "the run ended before training started"
    (outage,) = [o for o in r["store_outages"] if o["node"] == "node1"]
    assert outage["cause"] == "unreachable" and outage["store"] == "store1"
    assert outage["exit_code"] is None and outage["restarts"] == 0
    # found while it was cut off (a probe sent up to its 1 s timeout before the cut may be the one that missed)
    assert hosts_run.cut_at - 1.0 <= outage["died_at"] <= hosts_run.restored_at
    assert hosts_run.restored_at <= outage["back_at"] <= hosts_run.restored_at + 30  # and back once restored
    children = {c["name"]: c for c in json.loads((out / "logs" / "children.json").read_text())}
    assert children["store1"]["restarts"] == 0  # its process ran throughout: nothing restarted
    from launcher.report import table_rows
    from schemas.run_summary import PolicySummary

    rows = dict(table_rows(PolicySummary.model_validate(r)))
    assert f"node1: {outage['down_s']} cut off" in rows["store restarts (down s)"]
    steps = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines()]
    assert steps[-1]["t_end"] > hosts_run.restored_at  # the cut was mid-run: training went on after it
    assert r["trajectories_consumed"] == BATCHES * B * G and r["rollout"]["aborted_groups"] == 0
    resumed = min(s["t_end"] for s in steps if s["t_end"] > hosts_run.cut_at)
    print(f"\ncut {hosts_run.cut_at:.2f}; found unreachable +{outage['died_at'] - hosts_run.cut_at:.2f} s; "
          f"restored +{hosts_run.restored_at - hosts_run.cut_at:.2f} s; answers again "
          f"+{outage['back_at'] - hosts_run.cut_at:.2f} s; next step ended +{resumed - hosts_run.cut_at:.2f} s")


@pytest.mark.hosts
@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.slow
def test_a_store_process_killed_on_its_host_comes_back_there_from_its_spill_log(hosts_run: HostsRun) -> None:
    """SIGKILL of store node0's process on host 1 mid-run: the driver starts it again on host 1 (same port, same
    spill log), nothing acknowledged is lost and nothing is trained twice (the first test checks every row)."""
    r, out = hosts_run.result, hosts_run.out
    assert hosts_run.killed_at > 0, "the run ended before training started"
    (outage,) = [o for o in r["store_outages"] if o["node"] == "node0"]
    assert outage["store"] == "store0" and outage["exit_code"] == -signal.SIGKILL and outage["restarts"] == 1
    assert hosts_run.killed_at - 0.1 <= outage["died_at"] <= hosts_run.killed_at + 5
    assert outage["back_at"] > outage["died_at"]
    assert r["store_restarts"] == 1
    store0 = _child(out, "store0")
    assert store0["pid"] != hosts_run.killed_pid and store0["restarts"] == 1
    assert store0["cmd"][:3] == ["ip", "netns", "exec"] and store0["cmd"][3].endswith("h1")  # back on host 1
    stats = json.loads((out / "store_stats.json").read_text())
    node0 = next(s for s in stats.values() if s["node"] == "node0")
    assert node0["spill_bytes"] > 0  # it came back from its spill log
    assert r["duplicate_rows"] == 0 and r["trajectories_consumed"] == BATCHES * B * G
    print(f"\nkilled store0 {hosts_run.killed_at:.2f}; found dead +{outage['died_at'] - hosts_run.killed_at:.2f} s; "
          f"back +{outage['back_at'] - hosts_run.killed_at:.2f} s")
