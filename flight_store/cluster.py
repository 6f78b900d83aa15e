"""A client's view of a store cluster: which node id each location has, which are down, and so which node owns a group.

Every node answers the ``cluster`` action with its own id (``self``) and, when it was configured
with one, the cluster's membership (``nodes``: id and location of each node), the view's
``version`` and the members routing leaves out now (``down``: the launcher tells the nodes with
``set_cluster`` when one is lost, and again when it is back; ``flight_store.membership``).
:func:`view_from` builds a :class:`ClusterView` from those answers and checks that they agree: every
configured node must list the same members, and a client's locations must be exactly those members.
The newest version among the answers says which members are down. Routing (``schemas.routing``)
then runs over the ids not down, so a group lands on the node the nodes themselves expect (a node
refuses a group that is not its own).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from schemas import routing
from schemas.replies import ClusterReply


@dataclass(frozen=True, slots=True)
class ClusterView:
    """Node ids by location, and the view's version."""

    ids: dict[str, str]
    """Location -> node id."""
    version: int
    """The cluster view's version (1 for nodes that form a cluster of their own)."""
    down: frozenset[str] = frozenset()
    """Locations routing leaves out (their nodes were found down)."""
    _by_id: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        routed = {v: k for k, v in self.ids.items() if k not in self.down}
        object.__setattr__(self, "_by_id", routed or {v: k for k, v in self.ids.items()})

    def owner(self, group_id: str) -> str:
        """The location of the node ``group_id`` belongs to (among the nodes not down)."""
        if len(self._by_id) == 1:  # the one node wins whatever the scores
            return next(iter(self._by_id.values()))
        return self._by_id[routing.owner(group_id, list(self._by_id))]


def view_from(answers: Mapping[str, ClusterReply], locations: Sequence[str] = ()) -> ClusterView:
    """The cluster view of the nodes that gave these ``cluster`` answers (location -> answer).

    ``locations``: every location the client knows; one that did not answer (it is down or cut off) takes
    its id from the members the others list (else its location, a node's default id); it is down for routing
    only when the newest view says so (the nodes decide what they accept).

    Raises:
        ValueError: two nodes share an id, or a node's configured membership differs from the
            locations asked (naming both), or no node answered.
    """
    if not answers:
        msg = "no store node answered the cluster action"
        raise ValueError(msg)
    newest = max(answers.values(), key=lambda a: a.version)
    listed = {m.location: m.id for m in newest.nodes}
    silent = [loc for loc in locations if loc not in answers]
    ids = {loc: a.self_id for loc, a in answers.items()} | {loc: listed.get(loc, loc) for loc in silent}
    if len(set(ids.values())) != len(ids):
        msg = f"two store nodes report the same id: {ids}"
        raise ValueError(msg)
    versions = set()
    for loc, a in answers.items():
        members = {m.location: m.id for m in a.nodes}
        if len(members) > 1 and members != ids:
            msg = (f"node {loc} belongs to the cluster {members} (version {a.version}), but this client "
                   f"was given {ids}: give the client exactly the cluster's locations (or use from_cluster)")
            raise ValueError(msg)
        versions.add(a.version)
    down = {loc for loc, i in ids.items() if i in set(newest.down)}
    return ClusterView(ids=ids, version=max(versions, default=1), down=frozenset(down))
