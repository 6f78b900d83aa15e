"""``--hosts``: a benchmark across a real network stack, its store nodes on one host, its client on another.

Without ``--hosts`` a benchmark runs on this machine's loopback. With it, :func:`run_in_hosts` makes two
hosts (network namespaces on a bridge, :class:`launcher.hosts.Hosts`): it runs the benchmark's own
command again, without ``--hosts``, inside the *client* host, with :data:`STORE_HOST_ENV` naming the
*store* host; every store node the benchmark starts (:func:`start_node`) then runs inside the store host
(``python -m flight_store --config`` listening on that host's address), so every byte a client reads
crosses a veth pair and the bridge. Afterwards it adds ``params.hosts`` to the result file: the two
addresses and the bytes the store host's link carried. ``params.network`` (:func:`network_mode`) says
which mode a result was measured in. The hosts are always torn down (processes stopped by pid first).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from flight_store.config import ServerConfig
from flight_store.node import NodeProcess
from launcher.hosts import Hosts, HostsUnavailableError, check_available

STORE_HOST_ENV = "KNIT_BENCH_STORE_HOST"
"""``"<netns> <address>"`` of the host the store nodes run in; set by :func:`run_in_hosts` for the client side."""
ROOT = Path(__file__).resolve().parents[1]


def network_mode() -> str:
    """``"hosts"`` inside the client host of a ``--hosts`` run, else ``"loopback"`` (recorded as ``params.network``)."""
    return "hosts" if os.environ.get(STORE_HOST_ENV) else "loopback"


def start_node(config: ServerConfig) -> NodeProcess:
    """A store node in a child process: in the store host during a ``--hosts`` run, else on loopback."""
    where = os.environ.get(STORE_HOST_ENV, "").split()
    if len(where) == 2:  # listening on the store host's address; ``ip netns exec`` execs the node (same pid)
        netns, address = where
        return NodeProcess(replace(config, host=address, advertise_host=None), prefix=["ip", "netns", "exec", netns])
    return NodeProcess(config)


def run_in_hosts(module: str, argv: Sequence[str], out: Path) -> int:
    """Run ``python -m module argv`` (``--hosts`` removed) inside a client host, its stores in a store host.

    Returns the benchmark's exit code, or 2 with the reason on stderr when hosts cannot be made here.
    """
    try:
        check_available(probe=True)
    except HostsUnavailableError as exc:
        print(f"python -m {module} --hosts: cannot run across hosts: {exc}", file=sys.stderr)
        return 2
    argv = [a for a in argv if a != "--hosts"]
    started = time.time()
    with Hosts(2) as hosts:
        store, client = hosts[0], hosts[1]
        env = {**os.environ, STORE_HOST_ENV: f"{store.netns} {store.address}",
               "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        before = store.link_bytes()
        rc = client.popen([sys.executable, "-m", module, *argv], env=env).wait()
        moved = store.link_bytes() - before
    if out.exists() and out.stat().st_mtime >= started:  # written by this run
        doc = json.loads(out.read_text())
        if doc.get("params", {}).get("network") == "hosts":
            doc["params"]["hosts"] = {"store_host": store.address, "client_host": client.address,
                                      "store_link_rx_bytes": moved.rx, "store_link_tx_bytes": moved.tx}
            out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return rc
