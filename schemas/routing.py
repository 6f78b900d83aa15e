"""Which store node a prompt group belongs to: rendezvous (highest-random-weight) hashing over node ids.

Part of the wire protocol, so any client in any language routes exactly as the Python client and
the nodes do. For a group id ``g`` and the ids of the cluster's nodes (the ``cluster`` action lists
them):

    score(node, g) = the first 8 bytes, big-endian unsigned, of SHA-256(utf8(node) + b"\\x00" + utf8(g))
    owner(g)       = the node with the highest score (a tie, which needs a SHA-256 collision of the
                     first 8 bytes, goes to the larger node id in byte order)

Adding or removing one node moves only the groups that node wins or held (about 1/N of them); the
order in which nodes are listed does not matter. A node that knows its cluster refuses a group it
does not own and names the owner.

Example:
    >>> owner("step0-p0", ["node0", "node1", "node2"]), owner("g1", ["node0", "node1", "node2"])
    ('node1', 'node2')
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

ROUTING = "rendezvous-sha256"
"""The routing function's name, as the ``cluster`` action reports it."""


def score(node_id: str, group_id: str) -> int:
    """The weight of ``node_id`` for ``group_id`` (a 64-bit unsigned integer)."""
    digest = hashlib.sha256(node_id.encode() + b"\x00" + group_id.encode()).digest()
    return int.from_bytes(digest[:8], "big")


def owner(group_id: str, node_ids: Sequence[str]) -> str:
    """The node ``group_id`` belongs to among ``node_ids`` (any order)."""
    if not node_ids:
        msg = "routing needs at least one node id"
        raise ValueError(msg)
    return max(node_ids, key=lambda n: (score(n, group_id), n.encode()))
