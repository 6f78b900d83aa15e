"""The actors of ``knit run --ray`` (plain classes; ``ray.remote`` wraps them when a deployment starts, pinned to
their Ray node by :func:`pinned`) and the two network helpers they and the driver share."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import replace
from typing import Any, Literal

from flight_store.config import ServerConfig
from flight_store.net import free_port, free_ports

Engine = Literal["vllm", "fake"]


class StoreNodeActor:
    """One store node in this actor's process, on the node at ``ip``."""

    def __init__(self, ip: str) -> None:
        self.ip = ip
        self.server: Any = None

    def ports(self) -> tuple[int, int]:
        """Two ports free on this node now: the node's and its metrics'."""
        store, metrics = free_ports(2, self.ip)
        return store, metrics

    def start(self, config: ServerConfig) -> str:
        """Serve ``config`` (its RSS held to the budget, as ``knit serve`` does); returns the location."""
        from flight_store.server import StoreServer

        self.server = StoreServer(replace(config, store=replace(config.store, rss_guard=True)))
        return str(self.server.location)

    def serve(self) -> None:
        """Return when the node stops (the driver holds this call: the actor's death is its error)."""
        self.server.wait()

    def stop(self) -> bool:
        """Stop serving; whether it stopped cleanly."""
        return bool(self.server.shutdown()) if self.server is not None else True


class RolloutActor:
    """The rollout worker (``connectors.rollout.run_rollout``)."""

    def run(self, config: Any, engine: Engine) -> dict[str, Any]:
        """Run until ``config.max_groups`` groups are written; the report without ``write_times``."""
        from connectors.rollout import run_rollout

        fake = None
        if engine == "fake":
            from connectors.fake_engine import FakeEngine
            fake = FakeEngine(seed=config.seed)
        out = run_rollout(config, engine=fake).to_dict()
        return {k: v for k, v in out.items() if k != "write_times"}


class TrainerRankActor:
    """One trainer rank (``train.launch.launch`` under a torch.distributed environment)."""

    def __init__(self, ip: str) -> None:
        self.ip = ip

    def rendezvous_port(self) -> int:
        """A port free on this node (rank 0's rendezvous)."""
        return free_port(self.ip)

    def run(self, cfg: Any, env: dict[str, str]) -> int:
        """Join the group ``env`` describes and train; returns the rank."""
        from train.launch import launch

        ifname = interface_of(self.ip)
        os.environ.update(env)
        if ifname is not None and "GLOO_SOCKET_IFNAME" not in env:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname  # gloo would bind the hostname's address otherwise
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{env['RANK']}] %(name)s %(message)s")
        launch(cfg, 1)
        return int(env["RANK"])


def interface_of(ip: str) -> str | None:
    """The network interface that holds ``ip`` here (None when none does or psutil is missing)."""
    try:
        import psutil
    except ImportError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return str(name)
    return None


def local_ip_towards(address: str) -> str:
    """This machine's IP on the route to ``host:port`` (the driver's node IP for ``ray.init``)."""
    host = address.rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: no packet is sent
        return str(s.getsockname()[0])


def pinned(ray: Any, cls: type, node_id: str, cpus: float) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    return ray.remote(cls).options(num_cpus=cpus, max_restarts=0, max_concurrency=2 if cls is StoreNodeActor else 1,
                                   scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
