"""What the Ray driver holds of a deployment (:class:`Deployment`: its nodes and components, never payload) and the
errors :func:`launcher.ray_deploy.run_on_ray` raises."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from launcher.ray_stores import RayStores


class RayUnavailableError(ImportError):
    """Ray is not installed (``pip install knittrans[bench]``, or ``pip install ray``)."""


class RayDeployError(RuntimeError):
    """A component of the deployment failed (not because its node was lost); names the component and its node."""


class RayNodeLostError(RuntimeError):
    """A Ray node the run used was lost; names the node (IP and Ray id) and what ran on it.

    Attributes: ``node_ip``, ``node_id``, ``components`` (e.g. ``["store node1", "trainer rank 1"]``),
    ``accounting`` (what ``lost_node.json`` holds).
    """

    def __init__(self, node_ip: str, node_id: str, components: list[str], accounting: dict[str, Any]) -> None:
        self.node_ip, self.node_id, self.components, self.accounting = node_ip, node_id, components, accounting
        lost = accounting.get("groups_lost_unconsumed")
        super().__init__(f"Ray node {node_ip} ({node_id[:12]}) was lost mid-run with {', '.join(components)}; "
                         f"{lost} unconsumed group(s) it held are lost; the run was stopped")


@dataclass(frozen=True, slots=True)
class RayNode:
    """A Ray node as the driver sees it (one entry of ``ray.nodes()``)."""

    id: str
    """Ray's node id."""
    ip: str
    """The address its raylet advertises."""
    alive: bool
    cpus: float
    """The CPU slots it offers (0: a head kept for the GCS and the driver)."""

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> RayNode:
        """The node ``ray.nodes()`` describes by ``raw`` (Ray's own keys)."""
        return cls(id=raw["NodeID"], ip=raw["NodeManagerAddress"], alive=bool(raw["Alive"]),
                   cpus=float(raw.get("Resources", {}).get("CPU", 0)))


@dataclass(slots=True)
class DriverBytes:
    """Bytes the driver received, by what carried them (none of it payload)."""

    actor_returns: int = 0
    """Pickled values the actors returned."""
    metadata: int = 0
    """The stores' metadata collected at the end."""
    stats: int = 0
    """The stores' counters polled while the run goes."""


@dataclass(slots=True)
class Component:
    name: str
    """``store node{i}``, ``rollout``, ``trainer rank {r}``."""
    node_id: str
    node_ip: str
    actor: Any
    ref: Any = None
    """The actor's running call (a store's ``serve``, the rollout's and the trainer ranks' ``run``)."""


@dataclass(slots=True)
class Deployment:
    """What the driver holds: handles, node ids and addresses, configs; nothing of the payload."""

    nodes: list[RayNode]
    """The Ray nodes the run places on; a node lost for good is taken out."""
    stores: list[Component] = field(default_factory=list)
    rollout: Component | None = None
    ranks: list[Component] = field(default_factory=list)
    locations: list[str] = field(default_factory=list)
    keeper: RayStores | None = None  # keeps the store actors up
    lost: list[str] = field(default_factory=list)
    """Ray ids of the nodes lost for good (their stores stay down in the cluster view)."""
    driver_bytes: DriverBytes = field(default_factory=lambda: DriverBytes())

    @property
    def components(self) -> list[Component]:
        return [*self.stores, *([self.rollout] if self.rollout else []), *self.ranks]

    def on(self, node_id: str) -> list[str]:
        return [c.name for c in self.components if c.node_id == node_id]

    @property
    def live_stores(self) -> list[Component]:
        return [s for s in self.stores if s.node_id not in self.lost]
