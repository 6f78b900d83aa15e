"""A node's supply to come: the groups in flight the rollout registered here, and the trainer's demand.

The ``dispatch``, ``resolve``, ``demand`` and ``inflight`` actions land here. The table of groups in
flight lives in the store's contents (:class:`~flight_store.dispatched.DispatchTable`: a write of a
group's rows resolves it), so every method takes the store's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from flight_store.contents import StoreContents
from schemas.replies import InflightReply
from schemas.wire import DispatchedGroup


class Supply:
    """The groups in flight on one node and the demand the trainer published (shown in ``stats``)."""

    def __init__(self, contents: StoreContents, lock: threading.RLock) -> None:
        self._contents = contents
        self._lock = lock
        self.demand: dict[str, int] = {}
        """Groups per data source the trainer needs and nothing running brings."""

    def dispatch(self, groups: Iterable[DispatchedGroup]) -> list[str]:
        """Register groups in flight (or update their state); returns the ids already written here, which
        are not registered (a registration that arrives after its group's rows changes nothing)."""
        stored: list[str] = []
        with self._lock:
            c = self._contents
            for g in groups:
                if g.group_id in c.groups:
                    stored.append(g.group_id)
                    continue
                c.dispatched.register(g.group_id, g.data_source, g.prompt_id, g.dispatch_version, g.state)
        return stored

    def resolve(self, group_ids: Iterable[str], reason: str) -> int:
        """Take groups out of flight without rows (``reason``: aborted, filtered, cancelled); returns how many were."""
        with self._lock:
            return sum(self._contents.dispatched.resolve(g, reason) for g in dict.fromkeys(group_ids))

    def set_demand(self, classes: dict[str, int]) -> None:
        """Record what the trainer needs and nothing running brings (groups per data source)."""
        with self._lock:
            self.demand = dict(classes)

    def inflight(self) -> InflightReply:
        """The groups in flight here, with the registration and resolution counts (the ``inflight`` action)."""
        with self._lock:
            return InflightReply.model_validate(self._contents.dispatched.snapshot())
