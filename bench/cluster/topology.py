"""The cluster of the cluster benchmark: hosts with capped links, a Ray cluster across them, store nodes, a sampler.

:func:`run_cluster` makes ``1 + N + D`` hosts (:class:`launcher.hosts.Hosts`): host 1 is the driver (verl's
single controller, the Ray head, TransferQueue's controller), hosts ``2..N+1`` the rollout/store hosts (a
Ray node each, one knittrans store node each), the last ``D`` the trainer-rank hosts. Every host's link is
capped with a token bucket on both ends of its veth (:meth:`launcher.hosts.Host.shape`). The Ray nodes run
``ray start --block`` with token auth (one random token for the cluster) and a temp dir of their own; each
offers custom resources the actors are placed by (``store<i>``, ``rank<j>``, ``tq_store``), and CPUs so
that TransferQueue's controller lands on the driver host, its storage units one per store host, and verl's
rank bundles (``rank_host_cpus`` CPUs each) only on rank hosts. The driver program
(:mod:`bench.cluster.driver`) runs inside the driver host; meanwhile :class:`Sampler` reads every host's
link counters and the CPU time of every process inside each host, so that each measured step gets the bytes
each link carried and the CPU each host used. Teardown always: the store nodes, then every process inside
the hosts by pid (the Ray nodes and their workers included), then the hosts.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flight_store.config import ServerConfig
from flight_store.node import NodeProcess
from launcher.hosts import Host, Hosts

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
RAY_PORT = 6379


@dataclass(kw_only=True, slots=True)
class ClusterShape:
    """How many hosts of each role, and their links."""

    n_stores: int
    """N: rollout/store hosts."""
    n_ranks: int
    """D: trainer-rank hosts."""
    link_mbit: float
    """Every host's link rate, each way (Mbit/s)."""
    rank_host_cpus: int = 2
    """Ray CPUs of a rank host (verl's rank bundle takes them all, so one rank lands per rank host)."""
    object_store_mb: int = 1024
    """Ray object store of each node (MiB)."""

    def __post_init__(self) -> None:
        if self.n_stores < 1 or self.n_ranks < 1 or self.link_mbit <= 0:
            msg = f"n_stores={self.n_stores}, n_ranks={self.n_ranks} must be >= 1 and link_mbit={self.link_mbit} > 0"
            raise ValueError(msg)


class Sampler:
    """Every ``period_s``: each host's link counters and the CPU ticks of every process inside it (by pid)."""

    def __init__(self, hosts: list[Host], period_s: float = 0.2) -> None:
        self.hosts, self.period_s = hosts, period_s
        self.inode = {os.stat(f"/run/netns/{h.netns}").st_ino: i for i, h in enumerate(hosts)}
        self.samples: list[tuple[float, list[tuple[int, int]], dict[int, tuple[int, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cluster-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            links = [(lb.rx, lb.tx) for lb in (h.link_bytes() for h in self.hosts)]
            self.samples.append((time.time(), links, self._ticks()))

    def _ticks(self) -> dict[int, tuple[int, int]]:
        """``pid -> (host index, utime + stime ticks)`` of every process inside a host."""
        out = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                host = self.inode.get(os.stat(f"/proc/{name}/ns/net").st_ino)
                if host is None:
                    continue
                fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
                out[int(name)] = (host, int(fields[11]) + int(fields[12]))
            except (OSError, IndexError, ValueError):
                continue
        return out

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Bytes each host's link carried (interpolated at ``t0``, ``t1``) and each host's CPU use (0-1 of one
        core) between the samples nearest inside the window."""
        times = [s[0] for s in self.samples]
        if len(times) < 2:
            return {}

        def at(t: float) -> list[tuple[float, float]]:
            k = min(max(bisect.bisect_left(times, t), 1), len(times) - 1)
            (ta, la, _), (tb, lb, _) = self.samples[k - 1], self.samples[k]
            f = min(max((t - ta) / (tb - ta), 0.0), 1.0) if tb > ta else 0.0
            return [(a[0] + f * (b[0] - a[0]), a[1] + f * (b[1] - a[1])) for a, b in zip(la, lb, strict=True)]

        l0, l1 = at(t0), at(t1)
        a = min(bisect.bisect_left(times, t0), len(times) - 1)
        b = max(bisect.bisect_right(times, t1) - 1, 0)
        if b <= a:  # a window shorter than a sampling period: the two samples around it
            a, b = max(a - 1, 0), min(a + 1, len(times) - 1)
        ta, _, pa = self.samples[a]
        tb, _, pb = self.samples[b]
        cpu = [0.0] * len(self.hosts)
        for pid, (host, ticks) in pb.items():
            cpu[host] += ticks - pa.get(pid, (host, 0))[1]
        hz = os.sysconf("SC_CLK_TCK")
        return {"rx": [int(y[0] - x[0]) for x, y in zip(l0, l1, strict=True)],
                "tx": [int(y[1] - x[1]) for x, y in zip(l0, l1, strict=True)],
                "cpu_cores": [c / hz / max(tb - ta, 1e-3) for c in cpu], "cpu_window_s": tb - ta}


def _ray_env(token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, OMP_NUM_THREADS="1", TQ_NUM_THREADS="2",
               RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    return env


def _ray_start(host: Host, head: str, tmp: Path, cpus: int, resources: dict[str, float], shape: ClusterShape,
               env: dict[str, str]) -> None:
    ray = str(Path(sys.executable).with_name("ray"))
    args = [ray, "start", "--block", "--node-ip-address", host.address, "--temp-dir", str(tmp / f"r{host.index}"),
            "--num-cpus", str(cpus), "--resources", json.dumps(resources),
            "--object-store-memory", str(shape.object_store_mb << 20), "--disable-usage-stats"]
    if host.address == head:
        args += ["--head", "--port", str(RAY_PORT), "--include-dashboard=false"]
    else:
        args += ["--address", f"{head}:{RAY_PORT}"]
    host.popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # One node at a time: a raylet gives up when its agents are slow to start, as they are when many start at once.
    deadline = time.monotonic() + 120
    while not list((tmp / f"r{host.index}").glob("session_*/metrics_agent_port_*")):
        if time.monotonic() > deadline:
            msg = f"the Ray node of {host} did not start within 120 s"
            raise RuntimeError(msg)
        time.sleep(0.5)


def _wait_port(address: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    msg = f"nothing listens on {address}:{port} after {timeout_s:.0f} s"
    raise RuntimeError(msg)


def run_cluster(shape: ClusterShape, workloads: dict[str, dict[str, Any]], ms_per_ktok: float,
                timeout_s: float) -> dict[str, Any]:
    """Run the driver program across a fresh cluster of this shape; its records, each step with its
    ``links`` (bytes per host) and ``cpu`` (per host), and the hosts' roles."""
    n, d = shape.n_stores, shape.n_ranks
    nodes: list[NodeProcess] = []
    with tempfile.TemporaryDirectory(prefix="kc") as tmpdir, Hosts(1 + n + d) as hosts:
        tmp = Path(tmpdir)
        driver, stores, ranks = hosts[0], hosts.hosts[1:1 + n], hosts.hosts[1 + n:]
        try:
            for h in hosts:
                h.shape(shape.link_mbit)
            env = _ray_env(secrets.token_hex(16))
            _ray_start(driver, driver.address, tmp, 1, {"driver": 1}, shape, env)
            _wait_port(driver.address, RAY_PORT, 120)
            for i, h in enumerate(stores):
                _ray_start(h, driver.address, tmp, 1, {"tq_store": 1, f"store{i}": 1}, shape, env)
            for j, h in enumerate(ranks):
                _ray_start(h, driver.address, tmp, shape.rank_host_cpus, {f"rank{j}": 1}, shape, env)
            nodes = [NodeProcess(ServerConfig(host=h.address, log_level="WARNING"), prefix=h.exec_prefix)
                     for h in stores]
            spec = {"head": driver.address, "driver_address": driver.address, "n_stores": n, "n_ranks": d,
                    "stores": [x.location for x in nodes], "rank_host_cpus": shape.rank_host_cpus,
                    "ms_per_ktok": ms_per_ktok, "workloads": workloads}
            (tmp / "spec.json").write_text(json.dumps(spec))
            with Sampler(hosts.hosts) as sampler:
                proc = driver.popen([sys.executable, "-m", "bench.cluster.driver", str(tmp / "spec.json"),
                                     str(tmp / "raw.json")], env=env)
                rc = proc.wait(timeout=timeout_s)
            if rc != 0:
                msg = f"the driver program exited {rc} (N={n}, D={d})"
                raise RuntimeError(msg)
            raw = json.loads((tmp / "raw.json").read_text())
        finally:
            for node in nodes:
                node.stop()
    for per_kind in raw.values():
        for recs in per_kind["steps"].values():
            for rec in recs:
                rec["hosts"] = sampler.window(rec["t0"], rec["t1"])
    raw["roles"] = ["driver"] + [f"store{i}" for i in range(n)] + [f"rank{j}" for j in range(d)]
    return raw
