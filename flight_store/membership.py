"""A node's side of its cluster: the members, which of them routing leaves out now, and the view's version.

A node starts with the membership its config names (``ServerConfig.cluster``, ``cluster_version``) and every
member routed to. Whoever watches the nodes (the launcher) tells each node a newer view with the
``set_cluster`` action when a member goes down or comes back: routing (``schemas.routing``) then runs over the
members not down, so a lost node's groups go to the nodes alive and the version goes up. The rules:

* the version only grows: a view not newer than the node's changes nothing (the launcher may tell the nodes in
  any order, and a node started again from its config learns the current view from the next one it is told);
* a group is this node's when routing over the members not down (the home node its id names, else rendezvous
  hashing) gives it this node's id; a node refuses any
  other (:class:`~flight_store.errors.WrongNodeError`, naming the owner) so two writers never put one group on
  two nodes under one view;
* a view that marks every member down routes over all of them (a cluster of nobody routes nowhere).
"""

from __future__ import annotations

import threading

from flight_store.config import ClusterMember
from flight_store.errors import WrongNodeError
from schemas import replies, routing
from schemas.routing import ROUTING
from schemas.wire import SetClusterBody, WireError


class Membership:
    """The cluster as one node sees it (thread-safe: a ``set_cluster`` may arrive while writes are checked).

    Example:
        >>> m = Membership([ClusterMember(id="a", location="grpc://h:1"), ClusterMember(id="b", location="grpc://h:2")],
        ...                self_id="a", version=1)
        >>> m.update(SetClusterBody(version=2, down=["b"])).version
        2
        >>> m.check_owner("any group")  # b is down: every group is a's
    """

    def __init__(self, members: list[ClusterMember], *, self_id: str, version: int) -> None:
        self.members = members
        self.self_id = self_id
        self._version = version
        self._down: frozenset[str] = frozenset()
        self._lock = threading.Lock()

    def view(self) -> replies.ClusterReply:
        """The ``cluster`` action's answer: the routing, the view's version, the members, those down, this id."""
        with self._lock:
            version, down = self._version, self._down
        return replies.ClusterReply(routing=ROUTING, version=version, self_id=self.self_id, down=sorted(down),
                                    nodes=[replies.ClusterNode(id=m.id, location=m.location) for m in self.members])

    def update(self, body: SetClusterBody) -> replies.ClusterReply:
        """Take ``body``'s view when it is newer than this node's; the view in force after it.

        Raises:
            WireError: ``down`` names an id that is not a member (naming it and the members; the client receives a
                ``WireDecodeError``).
        """
        ids = {m.id for m in self.members}
        unknown = sorted(set(body.down) - ids)
        if unknown:
            msg = f"set_cluster: {unknown} are not members of this cluster {sorted(ids)}"
            raise WireError(msg)
        with self._lock:
            if body.version > self._version:
                self._version, self._down = body.version, frozenset(body.down)
        return self.view()

    def check_owner(self, group_id: str) -> None:
        """Refuse a group that routing gives another node of the cluster (:class:`WrongNodeError` names it)."""
        if len(self.members) < 2:
            return
        with self._lock:
            down = self._down
        routed = [m.id for m in self.members if m.id not in down] or [m.id for m in self.members]
        owner = routing.owner(group_id, routed)
        if owner != self.self_id:
            where = next(m.location for m in self.members if m.id == owner)
            how = "its id names that node" if routing.home(group_id, routed) == owner else "rendezvous hashing"
            msg = (f"group {group_id!r} belongs to node {owner} ({where}), not to node {self.self_id}: {how} "
                   f"(routing {ROUTING} over the cluster's ids not down; see the cluster action)")
            raise WrongNodeError(msg, group_id=group_id, owner=owner, location=where)
