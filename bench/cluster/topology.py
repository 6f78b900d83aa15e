"""The cluster of the cluster benchmark: hosts with capped links, a Ray cluster across them, store nodes, a sampler.

:func:`run_cluster` makes ``1 + N + D`` hosts (:class:`launcher.hosts.Hosts`): host 1 is the driver (verl's
single controller, the Ray head, TransferQueue's controller), hosts ``2..N+1`` the rollout/store hosts (a
Ray node each, one knittrans store node each), the last ``D`` the trainer-rank hosts. Every host's link is
capped with a token bucket of at most 16 KB on both ends of its veth (:meth:`launcher.hosts.Host.shape`).
The Ray nodes run ``ray start --block`` with token auth (one random token for the cluster) and a temp dir of
their own; each offers custom resources the actors are placed by (``store<i>``, ``rank<j>``, ``tq_store``),
and CPUs so that TransferQueue's controller lands on the driver host, its storage units one per store host,
and verl's rank bundles (``rank_host_cpus`` CPUs each) only on rank hosts. Store host ``i``'s node has the id
:func:`node_id` ``(i)``, the home a group id names for local placement. The driver program
(:mod:`bench.cluster.driver`) runs inside the driver host; meanwhile :class:`Sampler` reads every host's
link counters and the whole machine's CPU counters, so that each measured step gets the bytes each link
carried each way and the machine's busy fraction (every host shares the machine's cores). Teardown always:
the store nodes, then every process inside the hosts by pid (the Ray nodes and their workers included), then
the hosts.
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
from launcher.hosts import MAX_BURST_KB, Host, Hosts

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
RAY_PORT = 6379
AGENT_PORTS = {"--dashboard-agent-listen-port": 52365, "--dashboard-agent-grpc-port": 52366,
               "--metrics-export-port": 52367, "--runtime-env-agent-port": 52368}
"""Fixed ports of every Ray node's agents (each host has its own ports): a raylet given a port does not wait for its
agent to report it (it still waits a fixed 15 s for the dashboard agent's listen port, and aborts when, on a
loaded machine, the agent is later)."""
RAY_NODE_START_S = 600
"""Seconds a Ray node may take to start (its agents up): minutes when the machine's cores are busy."""


def node_id(i: int) -> str:
    """The id of store host ``i``'s node (its ``node_name``: what a home group id names)."""
    return f"node{i}"


@dataclass(kw_only=True, slots=True)
class ClusterShape:
    """How many hosts of each role, and their links."""

    n_stores: int
    """N: rollout/store hosts."""
    n_ranks: int
    """D: trainer-rank hosts."""
    link_mbit: float
    """Every host's link rate, each way (Mbit/s)."""
    burst_kb: int = 16
    """Token bucket of every link (KB): at most :data:`launcher.hosts.MAX_BURST_KB`, so every read is shaped."""
    rank_host_cpus: int = 2
    """Ray CPUs of a rank host (verl's rank bundle takes them all, so one rank lands per rank host)."""
    object_store_mb: int = 1024
    """Ray object store of each node (MiB)."""

    def __post_init__(self) -> None:
        if self.n_stores < 1 or self.n_ranks < 1 or self.link_mbit <= 0:
            msg = f"n_stores={self.n_stores}, n_ranks={self.n_ranks} must be >= 1 and link_mbit={self.link_mbit} > 0"
            raise ValueError(msg)
        if not 1 <= self.burst_kb <= MAX_BURST_KB:
            msg = f"burst_kb={self.burst_kb} must be 1..{MAX_BURST_KB} (a larger bucket lets small reads pass unshaped)"
            raise ValueError(msg)


class Sampler:
    """Every ``period_s``: each host's link counters and the whole machine's CPU counters (``/proc/stat``)."""

    def __init__(self, hosts: list[Host], period_s: float = 0.05) -> None:
        self.hosts, self.period_s = hosts, period_s
        self.samples: list[tuple[float, list[tuple[int, int]], tuple[int, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cluster-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def _sample(self) -> None:
        links = [(lb.rx, lb.tx) for lb in (h.link_bytes() for h in self.hosts)]
        self.samples.append((time.time(), links, machine_ticks()))

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Bytes each host's link carried each way and the machine's busy fraction, between the last sample at or
        before ``t0`` and the first at or after ``t1`` (the samples enclosing the window, so no byte of it is left
        out; the paths take turns, so no other path's bytes are in it)."""
        return window_of(self.samples, t0, t1)


def machine_ticks() -> tuple[int, int]:
    """``(busy, total)`` jiffies of all the machine's CPUs (``/proc/stat``'s ``cpu`` line; idle and iowait are
    not busy)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return total - fields[3] - fields[4], total


def window_of(samples: list[tuple[float, list[tuple[int, int]], tuple[int, int]]], t0: float,
              t1: float) -> dict[str, Any]:
    """:meth:`Sampler.window` over ``samples`` (time, per-host (rx, tx) counters, machine (busy, total) ticks)."""
    times = [x[0] for x in samples]
    if len(times) < 2:
        return {}
    a = max(bisect.bisect_right(times, t0) - 1, 0)
    b = min(bisect.bisect_left(times, t1), len(times) - 1)
    if b <= a:
        b = min(a + 1, len(times) - 1)
    (ta, la, ca), (tb, lb, cb) = samples[a], samples[b]
    busy, total = cb[0] - ca[0], cb[1] - ca[1]
    return {"rx": [y[0] - x[0] for x, y in zip(la, lb, strict=True)],
            "tx": [y[1] - x[1] for x, y in zip(la, lb, strict=True)],
            "machine_cpu": busy / total if total > 0 else 0.0, "window_s": tb - ta}


RAY_PATIENCE = {"RAY_health_check_timeout_ms": "60000", "RAY_health_check_failure_threshold": "20",
                "RAY_agent_register_timeout_ms": "300000", "RAY_raylet_start_wait_time_s": "300"}
"""Ray's health checks and a raylet's wait for its agents given minutes, not seconds: every host shares one
machine's cores, and under load a raylet whose agents start late exits, and a node the head misses a few
checks of is marked dead for good."""


def _ray_env(token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, OMP_NUM_THREADS="1", TQ_NUM_THREADS="2",
               RAY_USAGE_STATS_ENABLED="0", **RAY_PATIENCE,
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    return env


def _ray_start(host: Host, head: str, tmp: Path, cpus: int, resources: dict[str, float], shape: ClusterShape,
               env: dict[str, str]) -> None:
    ray = str(Path(sys.executable).with_name("ray"))
    args = [ray, "start", "--block", "--node-ip-address", host.address, "--temp-dir", str(tmp / f"r{host.index}"),
            "--num-cpus", str(cpus), "--resources", json.dumps(resources),
            "--object-store-memory", str(shape.object_store_mb << 20), "--disable-usage-stats",
            *(x for flag, port in AGENT_PORTS.items() for x in (flag, str(port)))]
    if host.address == head:
        args += ["--head", "--port", str(RAY_PORT), "--include-dashboard=false"]
    else:
        args += ["--address", f"{head}:{RAY_PORT}"]
    host.popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # One node at a time, each up (its raylet's socket there) before the next starts.
    deadline = time.monotonic() + RAY_NODE_START_S
    while not list((tmp / f"r{host.index}").glob("session_*/sockets/raylet*")):
        if time.monotonic() > deadline:
            msg = f"the Ray node of {host} did not start within {RAY_NODE_START_S} s"
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
                h.shape(shape.link_mbit, burst_kb=shape.burst_kb)
            env = _ray_env(secrets.token_hex(16))
            _ray_start(driver, driver.address, tmp, 1, {"driver": 1}, shape, env)
            _wait_port(driver.address, RAY_PORT, RAY_NODE_START_S)
            for i, h in enumerate(stores):
                _ray_start(h, driver.address, tmp, 1, {"tq_store": 1, f"store{i}": 1}, shape, env)
            for j, h in enumerate(ranks):
                _ray_start(h, driver.address, tmp, shape.rank_host_cpus, {f"rank{j}": 1}, shape, env)
            nodes = [NodeProcess(ServerConfig(host=h.address, node_name=node_id(i), log_level="WARNING"),
                                 prefix=h.exec_prefix) for i, h in enumerate(stores)]
            spec = {"head": driver.address, "driver_address": driver.address, "n_stores": n, "n_ranks": d,
                    "stores": [x.location for x in nodes], "node_ids": [node_id(i) for i in range(n)],
                    "rank_host_cpus": shape.rank_host_cpus, "link_mbit": shape.link_mbit,
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
    for per_kind in raw["workloads"].values():
        for recs in per_kind["steps"].values():
            for rec in recs:
                rec["hosts"] = sampler.window(rec["t0"], rec["t1"])
    raw["roles"] = ["driver"] + [f"store{i}" for i in range(n)] + [f"rank{j}" for j in range(d)]
    return raw
