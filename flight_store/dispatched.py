"""Groups in flight: dispatched to rollout (or queued for it) and not yet written, per node.

The rollout registers each group with the node that will store it when it commits to it (``queued``:
drawn from its loader; ``running``: in the engine), with its quota class (``data_source``), its
prompt and the policy version it was dispatched at. A group leaves the table when its rows are
written (the store's commit resolves it, under the same lock, so a reader never sees a group both in
flight and stored), or when the rollout resolves it without rows (``aborted``: the prompt goes out
again under a new id; ``filtered``; ``cancelled``). The planner reads the table as its in-flight
supply (``StoreReader.inflight``), so it runs the exact quota feasibility test.

In-flight entries are soft state: they are not written to the spill log, so a restarted node has
none until the rollout registers again; a planner that sees fewer groups in flight is only more
careful (it admits what the quotas allow from the groups it can count).

Not thread-safe by itself: the store calls it under its lock.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class Dispatched:
    """One group in flight."""

    group_id: str
    data_source: str
    prompt_id: str
    dispatch_version: int
    state: str
    dispatched_at: float
    """Unix time of its first registration."""


class DispatchTable:
    """The groups in flight on one node, and how many were registered and resolved (per reason)."""

    def __init__(self) -> None:
        self._groups: dict[str, Dispatched] = {}
        self.registered_total = 0
        """Distinct registrations ever (a state update of a group in flight is not counted again)."""
        self.resolved: Counter[str] = Counter()
        """Groups taken out of flight, per reason (``written`` when its rows arrived)."""

    def __len__(self) -> int:
        return len(self._groups)

    def register(self, group_id: str, data_source: str, prompt_id: str, dispatch_version: int, state: str) -> None:
        """Add a group, or update the state and version of one in flight (its first time stays)."""
        old = self._groups.get(group_id)
        if old is None:
            self.registered_total += 1
        self._groups[group_id] = Dispatched(group_id, data_source, prompt_id, dispatch_version, state,
                                            time.time() if old is None else old.dispatched_at)

    def resolve(self, group_id: str, reason: str) -> bool:
        """Take ``group_id`` out of flight; False when it was not in flight."""
        if self._groups.pop(group_id, None) is None:
            return False
        self.resolved[reason] += 1
        return True

    def snapshot(self) -> dict[str, Any]:
        """The ``inflight`` action's answer."""
        return {"groups": [asdict(d) for d in self._groups.values()],
                "registered_total": self.registered_total, "resolved": dict(self.resolved)}
