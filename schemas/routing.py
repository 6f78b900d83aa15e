"""Which store node a prompt group belongs to: its home node when its id names one, else rendezvous hashing.

Part of the wire protocol, so any client in any language routes exactly as the Python client and
the nodes do. For a group id ``g`` and the ids of the cluster's nodes that routing may use (the
``cluster`` action lists the members and those ``down``; routing uses the members not down):

    home(g)        = the node id h among them such that g starts with h + "/" (the longest such id)
    score(node, g) = the first 8 bytes, big-endian unsigned, of SHA-256(utf8(node) + b"\\x00" + utf8(g))
    owner(g)       = home(g) when there is one, else the node with the highest score (a tie, which needs a
                     SHA-256 collision of the first 8 bytes, goes to the larger node id in byte order)

A rollout worker that shares a host with a store node names that node in its group ids (``home_id``), so
its writes stay on its host (local placement); ids that name no node are spread by the hash. A home node
that is down is not among the ids routing uses, so its new groups fall back to the hash over the nodes
alive, and a retry after an unknown outcome computes the same owner from the same view. Adding or removing
one node moves only the hashed groups that node wins or held (about 1/N of them) and the groups homed on
it; the order in which nodes are listed does not matter. A node that knows its cluster refuses a group it
does not own and names the owner.

Example:
    >>> owner("step0-p0", ["node0", "node1", "node2"]), owner("g1", ["node0", "node1", "node2"])
    ('node1', 'node2')
    >>> owner(home_id("node0", "g1"), ["node0", "node1", "node2"]), owner("node0/g1", ["node1", "node2"])
    ('node0', 'node2')
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

ROUTING = "home-rendezvous-sha256"
"""The routing function's name, as the ``cluster`` action reports it."""

HOME_SEPARATOR = "/"
"""What follows a home node's id at the start of a group id."""


def score(node_id: str, group_id: str) -> int:
    """The weight of ``node_id`` for ``group_id`` (a 64-bit unsigned integer)."""
    digest = hashlib.sha256(node_id.encode() + b"\x00" + group_id.encode()).digest()
    return int.from_bytes(digest[:8], "big")


def home_id(node_id: str, rest: str) -> str:
    """A group id that names ``node_id`` as its home: ``<node_id>/<rest>``."""
    if not node_id or not rest:
        msg = f"a home group id needs a node id and a rest, got {node_id!r} and {rest!r}"
        raise ValueError(msg)
    return f"{node_id}{HOME_SEPARATOR}{rest}"


def home(group_id: str, node_ids: Sequence[str]) -> str | None:
    """The id among ``node_ids`` that ``group_id`` names as its home (the longest), or None."""
    named = [n for n in node_ids if group_id.startswith(n + HOME_SEPARATOR)]
    return max(named, key=len) if named else None


def owner(group_id: str, node_ids: Sequence[str]) -> str:
    """The node ``group_id`` belongs to among ``node_ids`` (any order): its home, else the rendezvous winner."""
    if not node_ids:
        msg = "routing needs at least one node id"
        raise ValueError(msg)
    named = home(group_id, node_ids)
    if named is not None:
        return named
    return max(node_ids, key=lambda n: (score(n, group_id), n.encode()))
