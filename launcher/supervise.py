"""The cluster view a launcher keeps: which store nodes are down, told to every node that answers.

Whoever starts the store nodes watches them (``launcher.stores`` for ``knit run`` locally and on hosts,
``launcher.ray_stores`` under Ray). When a node is lost (its process exited, or it stopped answering) the
launcher calls :meth:`ClusterViews.set_down` with every node down now; the view's version goes up and each
node that answers is told (``set_cluster``), so routing moves the lost node's groups to the nodes alive and the
clients follow (``flight_store.client``). When the node is back (started again from its spill log, or its link
restored) the next call brings it back into routing under a newer version. A node started again from its
config document holds version 1 until it is told: every change is told to every node, the node that came back
included; a node not down that did not take the view in force (it was still starting) is told it again at the
next call, at most every second; :meth:`ClusterViews.retell` repeats it at once.

Each change is recorded (:attr:`ClusterViews.changes`: version, the ids down, when), so a run's report can say
when routing moved and how long it took after the loss was found.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from flight_store.client import StoreAdmin

log = logging.getLogger(__name__)

TELL_TIMEOUT_S = 2.0
"""Seconds one node may take to answer ``set_cluster`` (a node cut off must not hold the launcher)."""


@dataclass(frozen=True, slots=True)
class ViewChange:
    """One new cluster view the launcher told the nodes."""

    version: int
    down: tuple[str, ...]
    """Ids of the nodes routing leaves out from this version on."""
    at: float
    """When it was told (unix time)."""
    told: tuple[str, ...]
    """Locations of the nodes that took it."""

    def to_dict(self) -> dict[str, object]:
        return {"version": self.version, "down": list(self.down), "at": round(self.at, 3), "told": list(self.told)}


class ClusterViews:
    """The launcher's cluster view over ``locations`` (``ids``: each one's node id; default: the locations).

    Thread-safe: the driver and a prober thread both call it.

    Example::

        views = ClusterViews(["grpc://10.0.0.1:8815", "grpc://10.0.0.2:8815"])
        views.set_down(["node1"])
        # -> 2
    """

    def __init__(self, locations: list[str], *, ids: list[str] | None = None, version: int = 1) -> None:
        self._locations = locations
        self._ids = ids if ids is not None else list(locations)
        self._nodes = len(locations)
        self._retold = 0.0
        self._lock = threading.Lock()
        self.version = version
        """The version of the view in force."""
        self.down: frozenset[str] = frozenset()
        """Ids of the nodes down in the view in force."""
        self.changes: list[ViewChange] = []
        """Every view told, in order."""

    def set_down(self, ids: Iterable[str]) -> int:
        """Make ``ids`` the nodes down (a new version when that changes the view) and tell every node that
        answers; returns the version in force."""
        down = frozenset(ids)
        with self._lock:
            if down == self.down:
                self._tell_missed()
                return self.version
            self.version += 1
            self.down = down
            told = self._tell(down)
            self.changes.append(ViewChange(self.version, tuple(sorted(down)), time.time(), tuple(told)))
            log.warning("cluster view v%d: nodes down %s (told %d node(s))", self.version, sorted(down) or "none",
                        len(told))
            return self.version

    def _tell_missed(self) -> None:
        """Tell the view in force again (at most every second) while a node not down has not taken it."""
        last = self.changes[-1] if self.changes else None
        if last is None or len(last.told) + len(self.down) >= self._nodes or time.time() - self._retold < 1.0:
            return
        self._retold = time.time()
        told = self._tell(self.down)
        self.changes[-1] = ViewChange(last.version, last.down, last.at, tuple(sorted(set(last.told) | set(told))))

    def retell(self) -> None:
        """Tell every node that answers the view in force again (a node that was started again holds v1)."""
        with self._lock:
            if self.version > 1:
                self._tell(self.down)

    def _tell(self, down: frozenset[str]) -> dict[str, object]:
        """``set_cluster`` to every node not down that answers, over fresh connections (one to a node that just came
        back may still sit in gRPC's reconnect backoff); a node down (cut off, say) would only hold the call."""
        up = [loc for loc, i in zip(self._locations, self._ids, strict=True) if i not in down]
        if not up:
            return {}
        with StoreAdmin(up, timeout=TELL_TIMEOUT_S, retries=0) as admin:
            return dict(admin.set_cluster(self.version, down))

    def close(self) -> None:
        """Nothing stays open between two views (kept for the callers' ``finally``)."""
