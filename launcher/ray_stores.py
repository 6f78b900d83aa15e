"""Store nodes under ``knit run --ray`` kept up: an actor whose process dies is started again on its Ray node.

Each store node runs in an actor pinned to its Ray node (``launcher.ray_deploy.StoreNodeActor``) that serves
until stopped: the driver holds one call per node (``serve``) that returns only when the node stops, so the
death of the actor's process (SIGKILL, the OOM killer) surfaces as that call's error. :class:`RayStores` then

1. leaves the node out of routing (``launcher.supervise.ClusterViews``: the cluster's version goes up, the
   writers send its new groups to the nodes alive, the readers stop asking it);
2. starts a new actor on the same Ray node with the same config (same port, same spill log in the run folder,
   so it comes back with every acknowledged group, released ones still released, under the same ``seq``);
3. brings it back into routing once it serves (a newer version), and records the outage as ``knit run`` does
   (``launcher.stores.Outage``).

A node restarted more than ``max_restarts`` times, or whose Ray node is gone (the new actor cannot start
there), is not kept up: :meth:`RayStores.restart` raises and the driver's lost-node handling takes over
(:meth:`RayStores.lose`: the node stays down in the view, its outage never ends).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from flight_store.config import ServerConfig
from launcher.stores import Outage, answers
from launcher.supervise import ClusterViews

log = logging.getLogger(__name__)


class RayStoreRestartError(RuntimeError):
    """A store node's actor died and could not be started again (names the node and why)."""


class RayStores:
    """Keeps the store actors of a Ray deployment up.

    Args:
        ray: the ``ray`` module.
        spawn: ``spawn(node_id, ip)`` -> a new store actor pinned to that Ray node.
        configs: each node's config (as it was started).
        locations: each node's location.
        max_restarts: times one node may be started again.
        start_timeout_s: seconds a restarted node may take to serve.
    """

    def __init__(self, ray: Any, spawn: Callable[[str, str], Any], configs: list[ServerConfig],
                 locations: list[str], *, max_restarts: int, start_timeout_s: float) -> None:
        self._ray = ray
        self._spawn = spawn
        self.configs = configs
        self.locations = locations
        self._max_restarts = max_restarts
        self._start_timeout_s = start_timeout_s
        self.views = ClusterViews(locations, ids=[str(c.node_name or c.location) for c in configs])
        """The cluster view told to the nodes."""
        self.outages: list[Outage] = []
        """Every store node that died and its way back."""

    def restart(self, i: int, node_id: str, ip: str, exc: BaseException) -> Any:
        """Node ``i``'s actor died (``exc``, its ``serve`` call's error): out of routing, started again on Ray node
        ``node_id``, back into routing; returns the new actor.

        Raises:
            RayStoreRestartError: too many restarts, or the new actor did not serve within ``start_timeout_s``.
        """
        cfg = self.configs[i]
        node = str(cfg.node_name)
        died = time.time()
        previous = sum(o.restarts for o in self.outages if o.node == node)
        if previous >= self._max_restarts:
            msg = f"store {node} on {ip} died again ({type(exc).__name__}) after {previous} restart(s)"
            raise RayStoreRestartError(msg) from exc
        log.warning("store %s on %s died (%s): out of routing, starting it again from its spill log", node, ip,
                    type(exc).__name__)
        self.views.set_down([o.node for o in self.outages if o.back_at is None] + [node])
        outage = Outage(store=f"store node{i}", node=node, location=self.locations[i], exit_code=None, died_at=died)
        self.outages.append(outage)
        actor = self._spawn(node_id, ip)
        try:
            location = self._ray.get(actor.start.remote(cfg), timeout=self._start_timeout_s)
        except Exception as err:
            msg = f"store {node} could not be started again on {ip}: {type(err).__name__}: {err}"
            raise RayStoreRestartError(msg) from err
        deadline = time.monotonic() + self._start_timeout_s
        while not answers(location):
            if time.monotonic() > deadline:
                msg = f"store {node} started again on {ip} does not answer at {location}"
                raise RayStoreRestartError(msg)
            time.sleep(0.2)
        outage.back_at = time.time()
        self.views.set_down([o.node for o in self.outages if o.back_at is None])
        log.warning("store %s is back on %s after %.1f s", node, location, outage.back_at - died)
        return actor

    def lose(self, indices: list[int]) -> None:
        """The nodes ``indices`` are lost for good with their Ray node: down in every cluster view from now on."""
        now = time.time()
        for i in indices:
            node = str(self.configs[i].node_name)
            outage = next((o for o in self.outages if o.node == node and o.back_at is None), None)
            if outage is None:
                outage = Outage(store=f"store node{i}", node=node, location=self.locations[i], exit_code=None,
                                died_at=now, restarts=0, cause="node_lost")
                self.outages.append(outage)
            outage.lost_at = now
        self.views.set_down([o.node for o in self.outages if o.back_at is None])

    def close(self) -> None:
        self.views.close()
